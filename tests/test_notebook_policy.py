"""The notebook output policy (tools/nbpolicy.py) holds for every notebook, and the checker can fail.

Every notebook under nbs/ is checked (one test per notebook, so the failure names it). The checker itself is tested on
small notebooks written here that break one rule each, on a clean one that breaks none, and through its CLI. The
JupyterLab open-and-autosave simulation (JavaScript numbers, joined streams, the server's nbformat write, then
nbdev_clean) is checked against node's real JSON.parse/JSON.stringify where node exists, and against the 60 lines the
issue saw change in kl_drift when it was opened in JupyterLab 4.6 (1.0 -> 1), reproduced from that commit's file.

Deliberate breaks of tools/nbpolicy.py, each seen failing here (on a copy): js_numbers keeping 1.0 a float
(test_js_numbers_match_node, test_roundtrip_changes_plotly_json_but_not_a_png); streams not joined
(test_roundtrip_changes_...); duplicates never reported (duplicate-figure, test_size_unreadable_and_duplicates_...);
the tqdm bar pattern dropped (test_checker_reports_the_rule[progress-bar]); the js_numbers break also fails
test_roundtrip_reproduces_the_issue_on_kl_drift and test_simulation_equals_a_real_jupyter_server_save (the simulation
checked against jupyter_server's own read and save of the file, with node parsing the model in between).
"""
import base64
import difflib
import importlib.util
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("nbpolicy", ROOT / "tools" / "nbpolicy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nbpolicy"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


P = _tool()
NOTEBOOKS = P.all_notebooks()


@pytest.fixture(scope="module")
def digests():
    return P.digest_index(NOTEBOOKS)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT / "nbs").as_posix())
def test_notebook_follows_the_policy(nb, digests):
    found = P.check_notebook(nb, digests)
    assert not found, f"{len(found)} violation(s) of tools/nbpolicy.py:\n" + "\n".join(map(str, found))


def test_every_notebook_is_found():
    names = {p.relative_to(ROOT / "nbs").as_posix() for p in NOTEBOOKS}
    assert {"00_loss.ipynb", "09_plots.ipynb", "index.ipynb", "explanations/findings.ipynb",
            "tutorials/gpu_qwen3.ipynb"} <= names
    assert not any(".ipynb_checkpoints" in n for n in names)


# --- the checker on notebooks written here ---------------------------------------------------------------------

def _png(w=4, h=3, seed=0) -> str:
    "A tiny valid RGB PNG, base64 (different bytes per seed)."
    import struct
    raw = b"".join(b"\x00" + bytes((seed + x + y) % 256 for x in range(3 * w)) for y in range(h))

    def chunk(k, d):
        return struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode()


def _nb(cells, kernelspec=True) -> dict:
    seen = set()
    for i, c in enumerate(cells):  # unique cell ids (nbformat would rewrite duplicates)
        c["id"] = c["id"] if c["id"] not in seen else f"{c['id']}x{i}"
        seen.add(c["id"])
    meta = {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}} if kernelspec else {}
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def _code(src="x = 1", outputs=(), cid="c0"):
    return {"cell_type": "code", "execution_count": None, "id": cid, "metadata": {}, "outputs": list(outputs),
            "source": src}


def _md(src, cid="m0"):
    return {"cell_type": "markdown", "id": cid, "metadata": {}, "source": src}


def _stream(text, name="stdout"):
    return {"name": name, "output_type": "stream", "text": text}


def _display(data):
    return {"data": data, "metadata": {}, "output_type": "display_data"}


def _write(folder: Path, name: str, nb: dict, clean=True) -> Path:
    "Write `nb` as nbdev_clean would (so only the rule under test can fire)."
    import nbformat
    p = folder / name
    text = nbformat.writes(nbformat.from_dict(nb), version=4)  # multi-line strings split, as on disk
    p.write_text(P.nbdev_clean_text(text) if clean else text, encoding="utf-8")
    return p


def _rules(path: Path, digests=None) -> set[str]:
    return {v.rule for v in P.check_notebook(path, digests or {})}


BAD = {  # rule -> a notebook breaking that rule (and only that one)
    "kernelspec": _nb([_code(outputs=[_stream("ok\n")])], kernelspec=False),
    "unexecuted": _nb([_code("#| default_exp foo"), _code("y = 2")]),
    "figure-json": _nb([_code(outputs=[_display({"application/vnd.plotly.v1+json": {"data": [], "layout": {}}})])]),
    "widget": _nb([_code(outputs=[_display({"application/vnd.jupyter.widget-view+json": {"model_id": "a"}})])]),
    "html-script": _nb([_code(outputs=[_display({"text/html": "<div></div><script>require(['plotly'])</script>"})])]),
    "image-twice": _nb([_code(outputs=[_display({"image/png": _png(), "image/jpeg": _png(seed=9)})])]),
    "image-size": _nb([_code(outputs=[_display({"image/png": base64.b64encode(bytes(130_000)).decode()})])]),
    "duplicate-figure": _nb([_code(outputs=[_display({"image/png": _png()})], cid="a"),
                             _code(outputs=[_display({"image/png": _png()})], cid="b")]),
    "text-size": _nb([_code(outputs=[_stream("".join(f"line {i}\n" for i in range(41)))])]),
    "html-size": _nb([_code(outputs=[_display({"text/html": "<table>" + "<tr><td>1</td></tr>" * 700 + "</table>"})])]),
    "abs-path": _nb([_code(outputs=[_stream("saved to /home/me/run/metrics.jsonl\n")])]),
    "progress-bar": _nb([_code(outputs=[_stream(" 50%|█████     | 1/2 [00:01<00:01]\n", "stderr")])]),
    "warning": _nb([_code(outputs=[_stream("<ipython-input>:3: FutureWarning: `x` is deprecated\n", "stderr")])]),
    "error-output": _nb([_code(outputs=[{"ename": "ValueError", "evalue": "bad", "output_type": "error",
                                         "traceback": ["ValueError: bad"]}])]),
    "link-html": _nb([_md("See [the loss](00_loss.html).")]),
    "link-absolute": _nb([_md("See [the loss](/docs/00_loss.ipynb).")]),
    "link-missing": _nb([_md("See [nothing](no_such_notebook.ipynb).")]),
    "cell-id": {**_nb([]), "cells": [_md("a", "same"), _md("b", "same")]},  # _nb would make the ids unique
}


@pytest.mark.parametrize("rule", sorted(BAD))
def test_checker_reports_the_rule(rule, tmp_path):
    if rule == "cell-id":  # written as is: nbformat's writer would renumber the duplicate, as JupyterLab does
        p = tmp_path / "bad.ipynb"
        p.write_text(P.nbdev_clean_text(json.dumps(BAD[rule])), encoding="utf-8")
        assert _rules(p) == {"cell-id", "jupyterlab-roundtrip"}
        return
    p = _write(tmp_path, "bad.ipynb", BAD[rule])
    idx = P.digest_index([p])
    assert _rules(p, idx) == {rule}
    assert rule in P.RULES


def test_every_rule_has_a_bad_example():
    assert set(P.RULES) - set(BAD) == {"size", "jupyterlab-roundtrip", "unreadable"}  # tested below


def test_clean_notebook_passes(tmp_path):
    "A notebook with outputs of every allowed kind, links that resolve, one PNG: no violation."
    (tmp_path / "other.ipynb").write_text("{}")
    nb = _nb([_code("#| default_exp foo"),
              _md("[other](other.ipynb), [a section](#Section), [web](https://example.org/x.html), ![](img.png)"),
              _code(outputs=[_stream("loss 0.25\n"), _display({"text/plain": "3", "text/html": "<b>3</b>"}),
                             _display({"image/png": _png(seed=1)})])])
    (tmp_path / "img.png").write_bytes(base64.b64decode(_png(seed=2)))
    p = _write(tmp_path, "good.ipynb", nb)
    assert P.check_notebook(p, P.digest_index([p])) == []


def test_size_unreadable_and_duplicates_across_notebooks(tmp_path):
    big = _nb([_code(outputs=[_stream("x\n" * 30)], cid=f"c{i}") for i in range(4000)])
    assert "size" in _rules(_write(tmp_path, "big.ipynb", big))
    (tmp_path / "broken.ipynb").write_text('{"cells": [')
    assert _rules(tmp_path / "broken.ipynb") == {"unreadable"}
    a = _write(tmp_path, "a.ipynb", _nb([_code(outputs=[_display({"image/png": _png(seed=5)})])]))
    b = _write(tmp_path, "b.ipynb", _nb([_code(outputs=[_display({"image/png": _png(seed=5)})])]))
    idx = P.digest_index([a, b])
    found = P.check_notebook(b, idx)
    assert [v.rule for v in found] == ["duplicate-figure"] and "a.ipynb cell 0" in found[0].msg


def test_cli_names_file_cell_and_rule(tmp_path):
    bad = _write(tmp_path, "bad.ipynb", BAD["abs-path"])
    good = _write(tmp_path, "good.ipynb", _nb([_code(outputs=[_stream("ok\n")])]))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "nbpolicy.py"), str(bad), str(good)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{bad.as_posix()}: cell 0 (id c0): abs-path: "), lines
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "nbpolicy.py"), str(good)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0 violation" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "nbpolicy.py"), str(tmp_path / "missing.ipynb")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "missing.ipynb" in r.stderr


# --- the JupyterLab round trip --------------------------------------------------------------------------------

def test_js_numbers_match_node(tmp_path):
    "js_numbers against JavaScript itself: JSON.stringify(JSON.parse(text)) in node."
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node binary")
    text = '[1.0, -0.0, 2.5, 1e-07, 1e+22, 1e20, 123456789.0, 9007199254740993, -3.0, true, null, "1.0", {"a": 0.0}]'
    js = "process.stdout.write(JSON.stringify(JSON.parse(require('fs').readFileSync(0, 'utf8'))))"
    r = subprocess.run([node, "-e", js], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    def typed(x):  # 1 == 1.0 in Python: compare types too
        if isinstance(x, dict):
            return {k: typed(v) for k, v in x.items()}
        return [typed(v) for v in x] if isinstance(x, list) else (type(x).__name__, x)
    assert typed(P.js_numbers(json.loads(text))) == typed(json.loads(r.stdout))
    assert json.dumps(P.js_numbers(json.loads(text))) != json.dumps(json.loads(text))  # the simulation changes things


def test_roundtrip_changes_plotly_json_but_not_a_png(tmp_path):
    "The break this guards: a figure saved as plotly JSON with 1.0 in it (what opening the notebook rewrote)."
    fig = {"data": [{"type": "scatter", "x": [0.0, 1.0, 2.0], "y": [0.5, 1.0, 0.25]}], "layout": {"width": 800}}
    plotly = _display({"application/vnd.plotly.v1+json": fig})
    with_json = _write(tmp_path, "json.ipynb", _nb([_code(outputs=[plotly])]))
    text = with_json.read_text()
    assert "1.0" in text and P.jupyterlab_roundtrip(text) != text
    assert "jupyterlab-roundtrip" in _rules(with_json)
    png = _write(tmp_path, "png.ipynb", _nb([_code(outputs=[_display({"image/png": _png(seed=3)}), _stream("a\n")]),
                                               _md("$x = 1.0$")]))
    assert P.jupyterlab_roundtrip(png.read_text()) == png.read_text()
    split = _write(tmp_path, "split.ipynb", _nb([_code(outputs=[_stream("a\n"), _stream("b\n")])]))
    assert "jupyterlab-roundtrip" in _rules(split)  # JupyterLab joins consecutive streams of one name
    dirty = _nb([_code(outputs=[_stream("a\n")]), {**_md("x"), "metadata": {"k": 1}}])
    dirty = _write(tmp_path, "dirty.ipynb", dirty, clean=False)
    assert "jupyterlab-roundtrip" in _rules(dirty)  # not nbdev_clean'ed: the clean after the visit changes it


def test_roundtrip_reproduces_the_kl_drift_visit():
    "A JupyterLab visit once changed 60 lines of kl_drift (1.0 -> 1, at 264131a); the simulation finds the same."
    r = subprocess.run(["git", "show", "264131a:nbs/explanations/kl_drift.ipynb"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip("git history not available (shallow clone)")
    old = r.stdout
    new = P.jupyterlab_roundtrip(old)
    changed = [(a, b) for a, b in zip(*[[ln for ln in difflib.unified_diff(old.splitlines(), new.splitlines(),
                                                                            lineterm="", n=0)
                                          if ln[:1] == s and ln[:3] != s * 3] for s in "-+"])]
    assert len(changed) == 60
    def num(line):  # the number on a changed line: `  1.0,` or `"y": 1.0`
        return line[1:].split(":")[-1].strip(" ,")
    assert all(num(a).endswith(".0") and "." not in num(b) and float(num(a)) == float(num(b)) for a, b in changed)


def test_simulation_equals_a_real_jupyter_server_save(tmp_path):
    """The real thing, minus the page: jupyter_server's contents API reads a notebook, node parses and re-serialises the
    model as JupyterLab's browser does, the server saves it, nbdev_clean runs. Its result must equal
    jupyterlab_roundtrip's, on a figure stored as PNG (unchanged) and on kl_drift as commit 264131a had it (changed)."""
    import os
    import socket
    import time
    import urllib.request
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node binary")
    old = subprocess.run(["git", "show", "264131a:nbs/explanations/kl_drift.ipynb"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    if old.returncode != 0:
        pytest.skip("git history not available (shallow clone)")
    files = {"png.ipynb": (ROOT / "nbs" / "explanations" / "clip_analysis.ipynb").read_text(), "old.ipynb": old.stdout}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "policy-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, auth = f"http://127.0.0.1:{port}/api/contents/", {"Authorization": f"token {token}"}
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(urllib.request.Request(base, headers=auth), timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("jupyter_server did not start")
        for name, text in files.items():
            model = urllib.request.urlopen(urllib.request.Request(base + name, headers=auth), timeout=60).read()
            js = ("const m = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
                  "process.stdout.write(JSON.stringify({type: 'notebook', format: 'json', content: m.content}))")
            body = subprocess.run([node, "-e", js], input=model, capture_output=True, timeout=60, check=True).stdout
            put = urllib.request.Request(base + name, data=body, method="PUT",
                                         headers={**auth, "Content-Type": "application/json"})
            urllib.request.urlopen(put, timeout=60).read()
            real = P.nbdev_clean_text((tmp_path / name).read_text(encoding="utf-8"))
            assert real == P.jupyterlab_roundtrip(text), name
            assert (real == text) == (name == "png.ipynb"), name
    finally:
        server.terminate()
        server.wait(timeout=30)
