"""The explanation notebooks reproduce themselves from the results store.

Each explanation notebook, `findings` included, reads only `results/` (through `opsd.results`). Here every one is
run top to bottom in one in-process shell (execnb, as nbdev_test runs notebooks; cells flagged slow/gpu/vllm skipped,
as nbdev_test skips them), and the text it prints is compared with the text saved in the notebook: a change of the
store, of `opsd.results` or of a notebook's code that changes a printed number fails here, naming the cell. Figures
are not rendered (`Figure.show` does nothing here): only text is compared, and the README figure `kl_drift` writes is not
rewritten. A notebook whose study is not in the store yet is skipped.
"""
import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "nbs" / "explanations"
NOTEBOOKS = {"async_rollout": "smollm2-offpolicy", "clip_analysis": "toy-clips", "kl_drift": "toy-clips", "findings": "toy-clips",
             "padding_gap": "toy-padding", "privilege": "toy-privilege",
             "steps_per_rollout": "toy-steps-per-rollout"}
SKIP = re.compile(r"^\s*#\|\s*(slow|gpu|vllm)\b", re.M)


def _text(outputs: list) -> list[str]:
    "The text of a cell's outputs: streams, and the markdown (else plain) text of results that hold no image."
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            out.append("".join(o["text"]))
        elif o.get("output_type") in ("execute_result", "display_data"):
            d = o.get("data", {})
            if any(k.startswith("image/") or "json" in k for k in d): continue
            if "text/markdown" in d: out.append("".join(d["text/markdown"]))   # a verdict table (findings)
            elif "text/plain" in d: out.append("".join(d["text/plain"]))
    return ["".join(out)] if out else []


def test_every_explanation_is_listed():
    assert sorted(p.stem for p in FOLDER.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_explanation_reproduces_its_saved_text(name, monkeypatch):
    if not (ROOT / "results" / NOTEBOOKS[name]).exists():
        pytest.skip(f"results/{NOTEBOOKS[name]} is not in the store yet")
    from execnb.shell import CaptureShell
    import plotly.graph_objects as go
    import plotly.io as pio
    import opsd.plots
    nb = json.loads((FOLDER / f"{name}.ipynb").read_text())
    raw = [c for c in nb["cells"] if c["cell_type"] == "raw"]
    assert not any("skip_exec" in "".join(c["source"]) for c in raw), f"{name}: skip_exec in its front matter"
    monkeypatch.chdir(FOLDER)
    monkeypatch.setattr(opsd.plots, "notebook_figures", lambda *a, **k: "json")
    monkeypatch.setattr(go.Figure, "write_image", lambda self, *a, **k: None)
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: None)   # figures: not rendered, not compared
    monkeypatch.setattr(pio.renderers, "default", "json")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shell = CaptureShell()
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        src = "".join(c["source"])
        if SKIP.search(src):
            continue
        outputs = shell.run(src)
        errors = [o for o in outputs if o.get("output_type") == "error"]
        assert not errors, f"{name} cell {i} (id {c['id']}): {errors[0].get('ename')}: {errors[0].get('evalue')}"
        assert _text(outputs) == _text(c.get("outputs", [])), f"{name} cell {i} (id {c['id']}): printed text differs"
