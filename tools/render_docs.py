#!/usr/bin/env python
"""Render notebooks to standalone HTML pages that work offline (no quarto, no network).

    python tools/render_docs.py [NB ...] [--out DIR]      (default: nbs/00_loss.ipynb -> _docs_offline/)

The notebooks are NOT executed: their saved outputs are used. What makes the pages work offline:
* math: nbconvert's MathJax script points at a local MathJax 2.7 copy (from the pinned pip package
  `jupyter-server-mathjax`), copied to OUT/mathjax/, with the STIX-Web web fonts it ships;
* figures: output bundles with both `application/vnd.plotly.v1+json` and `image/png` show the embedded PNG
  (images are preferred over HTML/JS renderers, which would need plotly.js from a CDN);
* nothing else loads from a CDN: the require.js, mermaid and widget loaders of nbconvert's lab template are dropped;
* links: notebooks link to each other as relative `.ipynb` (what JupyterLab follows); on the pages they point to the
  rendered `.html`, and every page starts with a link to `contents.html` (written next to the pages).
nbdev cell directives are honoured loosely: `#| hide` drops the cell, `#| echo: false` hides its code,
`#| output: false` its outputs, and the directive lines themselves are not shown.
"""
from __future__ import annotations

import argparse
import copy
import html
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import nbformat
from jinja2 import DictLoader
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "_docs_offline"
MATHJAX_DIR = "mathjax"  # inside OUT
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"  # the combined configuration the pip package ships

# the pip package ships only the STIX-Web web fonts, so MathJax must be told to use them (its default is "TeX")
_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_mathjax -%}
<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null},
  MMLorHTML: {prefer: "HTML"},
  menuSettings: {zoom: "None"}
});
</script>
{{ super() }}
{%- endblock html_head_js_mathjax -%}
"""

# images first: a bundle that has a PNG next to an HTML/JS rendering (plotly) shows the PNG
DISPLAY_PRIORITY = ["image/png", "image/jpeg", "image/svg+xml", "image/gif", "text/html", "text/markdown",
                    "text/latex", "application/pdf", "text/plain"]

_DIRECTIVE = re.compile(r"^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")


def mathjax_source() -> Path:
    "The MathJax 2.7 static tree shipped by the `jupyter-server-mathjax` wheel."
    try:
        import jupyter_server_mathjax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("render_docs: needs the pip package jupyter-server-mathjax (see requirements-cpu.txt)") from e
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (src / "MathJax.js").is_file():
        raise SystemExit(f"render_docs: no MathJax.js under {src}")
    return src


def copy_mathjax(out: Path) -> Path:
    "Copy MathJax next to the pages once (skipped when the copy is already there and the same size)."
    src, dst = mathjax_source(), out / MATHJAX_DIR
    same = (dst / "MathJax.js").is_file() and (dst / "MathJax.js").stat().st_size == (src / "MathJax.js").stat().st_size
    if not same:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _directives(src: str) -> tuple[dict, str]:
    "nbdev `#| key: value` lines at the top of a code cell, and the source without them."
    lines, d = src.splitlines(), {}
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            if lines[i].strip():
                break
            i += 1
            continue
        d[m.group(1).lower()] = m.group(2).lower()
        i += 1
    return d, "\n".join(lines[i:]) if d else src


def prepare(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "A copy of `nb` with nbdev directives applied and nothing that needs the network (widget state)."
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    cells = []
    for c in nb.cells:
        if c.cell_type == "code":
            d, src = _directives(c.source)
            if "hide" in d or d.get("include") == "false":
                continue
            c.source = src
            if d.get("echo") == "false":
                c.metadata["transient"] = {"remove_source": True}
            if d.get("output") == "false":
                c.outputs = []
        elif c.cell_type == "raw":
            continue  # quarto front matter and the like
        cells.append(c)
    nb.cells = cells
    return nb


def exporter(mathjax_url: str) -> HTMLExporter:
    e = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"opsd_offline.html.j2": _TEMPLATE})])
    e.template_file = "opsd_offline.html.j2"
    e.mathjax_url = mathjax_url
    e.require_js_url = ""
    e.embed_images = True  # markdown ![](images/..) becomes a data: URI, so pages can move
    e.exclude_input_prompt = True
    e.exclude_output_prompt = True
    e.display_data_priority = DISPLAY_PRIORITY
    return e


_NB_HREF = re.compile(r'(href=")(?![a-zA-Z][\w+.-]*:|/)([^"#?]+)\.ipynb((?:[#?][^"]*)?")')
CONTENTS = "contents.html"


def rewrite_links(body: str) -> str:
    "Relative links to notebooks (`x.ipynb`, `../tutorials/y.ipynb#part`) point to their rendered pages (`.html`)."
    return _NB_HREF.sub(lambda m: f"{m.group(1)}{m.group(2)}.html{m.group(3)}", body)


def add_nav(body: str, contents_href: str) -> str:
    "A link to the contents page at the top of the page body."
    nav = (f'<nav class="opsd-nav" style="max-width:1100px;margin:8px auto 0;padding:0 16px;font-size:14px">'
           f'<a href="{html.escape(contents_href)}">opsd: contents</a></nav>')
    body, n = re.subn(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)
    if n != 1:
        raise ValueError("render_docs: no <body> tag in the exported page")
    return body


def render(nb_path: Path, out: Path, base: Path | None = None) -> Path:
    "Render one notebook to OUT/<path relative to base>.html; returns the HTML path."
    nb_path = Path(nb_path).resolve()
    base = Path(base).resolve() if base else nb_path.parent
    try:
        rel = nb_path.relative_to(base)
    except ValueError:
        rel = Path(nb_path.name)
    dest = (out / rel).with_suffix(".html")
    dest.parent.mkdir(parents=True, exist_ok=True)
    mj = Path(os.path.relpath(out / MATHJAX_DIR / "MathJax.js", dest.parent)).as_posix()
    with warnings.catch_warnings():  # some notebooks lack cell ids; irrelevant for a render
        warnings.simplefilter("ignore", nbformat.validator.MissingIDFieldWarning)
        nb = prepare(nbformat.read(nb_path, as_version=4))
    body, _ = exporter(f"{mj}?config={MATHJAX_CONFIG}").from_notebook_node(
        nb, resources={"metadata": {"name": nb_path.stem, "path": str(nb_path.parent)}})
    contents = Path(os.path.relpath(out / CONTENTS, dest.parent)).as_posix()
    dest.write_text(add_nav(rewrite_links(body), contents), encoding="utf-8")
    return dest


def write_contents(out: Path, pages: list[Path], name: str) -> Path:
    items = "\n".join(f'<li><a href="{html.escape(p.relative_to(out).as_posix())}">'
                      f'{html.escape(p.relative_to(out).with_suffix("").as_posix())}</a></li>' for p in sorted(pages))
    path = out / name
    head = '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>opsd (offline docs)</title></head>\n'
    path.write_text(f'{head}<body><h1>opsd: offline pages</h1>\n<ul>\n{items}\n</ul></body></html>\n', encoding="utf-8")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="notebooks to render (default: nbs/00_loss.ipynb)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: _docs_offline/)")
    ap.add_argument("--base", type=Path, default=None,
                    help="folder the output layout is relative to (default: nbs/ when all notebooks are under it)")
    a = ap.parse_args(argv)
    nbs = a.notebooks or [ROOT / "nbs" / "00_loss.ipynb"]
    nbs = [p.resolve() for p in nbs]
    base = a.base
    if base is None:
        nbs_dir = (ROOT / "nbs").resolve()
        inside = all(p.is_relative_to(nbs_dir) for p in nbs)
        base = nbs_dir if inside else Path(os.path.commonpath([p.parent for p in nbs]))
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    copy_mathjax(out)
    pages = []
    for p in nbs:
        dest = render(p, out, base)
        pages.append(dest)
        print(dest)
    print(write_contents(out, pages, CONTENTS))  # every page links to it
    if (out / "index.html") not in pages and len(pages) > 1:
        print(write_contents(out, pages, "index.html"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
