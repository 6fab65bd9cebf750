"Structure: every module imports only modules whose notebook comes earlier in the notebook order (one-way imports)."

import ast, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "opsd"


def notebook_order() -> dict[str, str]:
    "module name -> the notebook it is exported from (its sort key is the notebook's file name, e.g. '05b_runs')."
    out = {}
    for py in PKG.glob("*.py"):
        m = re.search(r"File to edit: \.\./nbs/([\w/]+)\.ipynb", py.read_text())
        if m:
            out[py.stem] = m.group(1)
    return out


def opsd_imports(py: Path) -> set[str]:
    "Every opsd module `py` imports, at any depth (module level or inside functions)."
    names = set()
    for node in ast.walk(ast.parse(py.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:
                names |= {mod.split(".")[0]} if mod else {a.name for a in node.names}
            elif mod == "opsd":
                names |= {a.name for a in node.names}
            elif mod.startswith("opsd."):
                names.add(mod.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("opsd.")}
    return names


def test_every_module_comes_from_a_notebook():
    order = notebook_order()
    missing = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in order and p.stem not in ("__init__", "_modidx"))
    assert not missing, f"modules without a source notebook: {missing}"


def test_imports_are_one_way():
    order = notebook_order()
    bad = []
    for mod, nb in order.items():
        for dep in opsd_imports(PKG / f"{mod}.py"):
            if dep in order and dep != mod and order[dep] > nb:
                bad.append(f"{mod} ({nb}) imports {dep} ({order[dep]})")
    assert not bad, "imports against the notebook order:\n" + "\n".join(sorted(bad))


def test_the_check_can_fail(tmp_path):
    "The parser sees relative, absolute and function-level imports."
    f = tmp_path / "m.py"
    f.write_text(
        "from .train import x\nimport opsd.eval\ndef g():\n    from opsd.toy import y\n    from opsd import plots\n"
    )
    assert opsd_imports(f) == {"train", "eval", "toy", "plots"}
