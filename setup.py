"""Installs `opsd` from settings.ini (nbdev 2's template, without `pkg_resources`)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

cfg = ConfigParser(delimiters=["="])
cfg.read(Path(__file__).parent / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

for key in "version description keywords author author_email".split():
    assert key in cfg, f"settings.ini lacks {key}"

licenses = {
    "apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License"),
    "mit": ("MIT License", "OSI Approved :: MIT License"),
}
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable", "6 - Mature", "7 - Inactive"]
py_versions = "3.10 3.11 3.12 3.13".split()

lic = licenses.get(cfg["license"].lower(), (cfg["license"], None))
min_python = cfg["min_python"]
requirements = cfg.get("requirements", "").split()
dev_requirements = cfg.get("dev_requirements", "").split()
vllm_requirements = cfg.get("vllm_requirements", "").split()
readme = Path(__file__).parent / "README.md"

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    license=lic[0],
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"].title(),
        "Natural Language :: " + cfg["language"].title(),
    ]
    + ["Programming Language :: Python :: " + v for v in py_versions[py_versions.index(min_python):]]
    + (["License :: " + lic[1]] if lic[1] else []),
    url=cfg["git_url"],
    packages=setuptools.find_packages(include=["opsd", "opsd.*"]),
    include_package_data=True,
    install_requires=requirements,
    extras_require={"dev": dev_requirements, "vllm": vllm_requirements},
    dependency_links=cfg.get("dep_links", "").split(),
    python_requires=">=" + min_python,
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else cfg["description"],
    long_description_content_type="text/markdown",
    zip_safe=False,
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f"{cfg.get('lib_path')}={cfg.get('lib_path')}._modidx:d"],
    },
    author=cfg["author"],
    author_email=cfg["author_email"],
    description=cfg["description"],
    keywords=cfg["keywords"],
)
