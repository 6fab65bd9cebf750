"""Live figures: in a live kernel a figure's bundle carries the PNG and plotly's JSON (JupyterLab: hover and zoom);
saving through the Jupyter server with `opsd.plots.jupyter_pre_save` (what `bash dev.sh lab` configures) writes the same
file as a PNG-only run cleaned by nbdev_clean, also after the browser replaced the PNG with its own snapshot (what
JupyterLab's plotly renderer does once a figure was hovered). The server's real save path (FileContentsManager) is used.
Break seen failing: keep_png not re-rendering a replaced PNG (the snapshot is then saved)."""
import copy
import json

import nbformat
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from opsd import plots


@pytest.fixture(scope="module")
def bundles():
    if not plots.kaleido_ok():
        pytest.skip("no Chrome for kaleido")
    old = pio.renderers.default
    figs = [go.Figure(go.Scatter(x=[0, 1, 2], y=[1.0, 3.0, 2.0]), layout=dict(width=320, height=200, title="a"))]
    try:
        out = {}
        for live in (False, True):
            plots.notebook_figures(scale=0.5, live=live)
            out[live] = [pio.renderers._build_mime_bundle(f.to_dict()) for f in figs]
    finally:
        pio.renderers.default = old
    return out


def _nb(bundles, execution_count=None):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"display_name": "python3", "language": "python",
                                                           "name": "python3"}})
    for i, b in enumerate(bundles):
        c = nbformat.v4.new_code_cell(f"fig{i}.show()", id=f"c{i}")
        c.execution_count = execution_count
        c.outputs = [nbformat.v4.new_output("display_data", data=copy.deepcopy(b))]
        nb.cells.append(c)
    return nb


def test_live_bundle_has_both(bundles):
    assert all(set(b) == {"image/png"} for b in bundles[False])
    assert all(set(b) == {"image/png", plots.PLOTLY_MIME, plots.LIVE_MIME} for b in bundles[True])
    assert [b["image/png"] for b in bundles[True]] == [b["image/png"] for b in bundles[False]]


def test_jupyterlab_save_writes_the_committed_form(bundles, tmp_path, monkeypatch):
    from jupyter_server.services.contents.filemanager import FileContentsManager
    monkeypatch.chdir(tmp_path)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = x\nnbs_path = .\nallowed_metadata_keys = \n"
                                           "allowed_cell_metadata_keys = \njupyter_hooks = False\nclean_ids = True\n"
                                           "clear_all = False\n")
    want = _nb(bundles[False] * 2)        # what nbconvert + nbdev_clean give (execution counts cleared)
    live = _nb(bundles[True] * 2, execution_count=3)
    # after a hover JupyterLab's renderer stores the browser's own snapshot in place of the kernel's PNG
    live.cells[1].outputs[0]["data"]["image/png"] = "iVBORw0KGgo="
    cm = FileContentsManager(root_dir=str(tmp_path), pre_save_hook="opsd.plots.jupyter_pre_save")
    cm.save(dict(type="notebook", format="json", content=json.loads(nbformat.writes(live))), "a.ipynb")
    cm.save(dict(type="notebook", format="json", content=json.loads(nbformat.writes(want))), "b.ipynb")
    a, b = (tmp_path / "a.ipynb").read_text(), (tmp_path / "b.ipynb").read_text()
    assert plots.PLOTLY_MIME not in a and plots.LIVE_MIME not in a
    assert a == b and '"execution_count": null' in a
    # the clean step on a file on disk (bash dev.sh clean): the same PNGs
    f = tmp_path / "c.ipynb"
    f.write_text(nbformat.writes(_nb(bundles[True])))
    assert plots.keep_png_files([f]) == [str(f)] and plots.keep_png_files([f]) == []
    assert [c.outputs[0]["data"] for c in nbformat.read(f, as_version=4).cells] == bundles[False]
