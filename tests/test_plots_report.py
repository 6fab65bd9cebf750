"""Tests of opsd.plots (figures carry the frame's numbers, colours per clip mode, clear errors) and
opsd.report (a self-contained offline HTML page, PNGs through kaleido when a Chromium exists)."""

import json
import re
import shutil
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import polars as pl
import pytest

from opsd import plots, report
from opsd.plots import CLIP_COLORS


# the report's figures, in page order
REPORT_FIGURES = ("kl_drift", "loss_by_clip", "entry_loss_sign", "argmax_clipped", "grad_cos", "sampled_acc",
                  "clipped_mass_entry", "grad_cos_by_band", "accuracy_test")


@pytest.fixture(scope="module")
def metrics():
    return plots.synthetic_metrics(steps=20, seeds=(0, 1, 2))


def _legend(fig):
    return [d.name for d in fig.data if d.showlegend is not False and d.name]


# ---------------------------------------------------------------- plots
def test_kl_drift_single_replicate_is_the_raw_series(metrics):
    m = metrics.filter(pl.col("seed") == 1)
    fig = plots.kl_drift(m)
    assert isinstance(fig, go.Figure)
    assert _legend(fig) == ["entry", "scaled", "token", "none"]
    for d in fig.data:
        raw = m.filter(pl.col("clip") == d.name).sort("step")
        assert list(d.x) == raw["step"].to_list()
        np.testing.assert_allclose(d.y, raw["kl/true"].to_numpy())
        assert d.line.color == CLIP_COLORS[d.name]
    assert "nats" in fig.layout.yaxis.title.text


def test_kl_drift_mean_and_band_over_seeds(metrics):
    fig = plots.kl_drift(metrics)
    mean = next(d for d in fig.data if d.name == "entry (mean of 3)")
    band = next(d for d in fig.data if d.name == "entry ±1 sd")
    e = (
        metrics.filter(pl.col("clip") == "entry")
        .group_by("step")
        .agg(m=pl.col("kl/true").mean(), sd=pl.col("kl/true").std())
        .sort("step")
    )
    np.testing.assert_allclose(mean.y, e["m"].to_numpy())
    upper = np.asarray(band.y[: e.height])
    np.testing.assert_allclose(upper, (e["m"] + e["sd"]).to_numpy())
    assert band.fill == "toself"
    with_reps = plots.kl_drift(metrics, show_replicates=True)
    assert len(with_reps.data) == len(fig.data) + 4 * 3  # one thin line per (run, seed)


def test_by_run_and_other_labels(metrics):
    fig = plots.kl_drift(metrics.filter(pl.col("clip") == "entry"), by="run")
    assert sorted(_legend(fig)) == ["entry-s0", "entry-s1", "entry-s2"]
    assert plots.clip_color("something-else") == plots.clip_color("something-else")  # stable
    assert plots.clip_color("entry") == CLIP_COLORS["entry"]


def test_synthetic_metrics_encode_the_keys_meaning(metrics):
    # entry instruments exist on every run; update_cos is 1 for scaled/none; a none loss is its KL, never negative
    for clip, g in metrics.group_by("clip"):
        assert g["entry/neg_loss_frac"].max() > 0 and g["entry/argmax_clipped_frac"].min() > 0
    none = metrics.filter(pl.col("clip") == "none")
    assert (none["loss"] >= 0).all() and np.allclose(none["loss"], none["kl/true"], atol=1e-4)
    assert set(metrics.filter(pl.col("clip").is_in(["scaled", "none"]))["update_cos"].to_list()) == {1.0}
    e = metrics.filter(pl.col("clip") == "entry")
    assert (
        e["loss"].to_list() == e["entry/loss"].to_list() and e["update_cos"].to_list() == e["entry/grad_cos"].to_list()
    )
    assert e["loss"].min() < 0


def test_loss_by_clip_own_axis_and_zero_line(metrics):
    fig = plots.loss_by_clip(metrics)
    assert {d.xaxis for d in fig.data} == {"x", "x2", "x3", "x4"}  # a panel (own axes) per clip mode
    assert sum(1 for s in fig.layout.shapes if s.y0 == 0 and s.y1 == 0) == 4  # a zero line in each
    none_mean = next(d for d in fig.data if d.name == "none (mean of 3)")
    expect = metrics.filter(pl.col("clip") == "none").group_by("step").agg(pl.col("loss").mean()).sort("step")
    np.testing.assert_allclose(none_mean.y, expect["loss"].to_numpy())
    assert min(none_mean.y) >= 0


def test_entry_loss_sign_measured_on_every_run(metrics):
    fig = plots.entry_loss_sign(metrics)
    assert any(s.y0 == 0 and s.y1 == 0 for s in fig.layout.shapes)
    neg = [d for d in fig.data if d.yaxis == "y2"]
    assert len(neg) == 8  # band + mean per clip mode: the instrument exists for every run
    none_neg = next(d for d in neg if d.name.startswith("none") and d.fill != "toself")  # the mean, not its band
    expect = (
        metrics.filter(pl.col("clip") == "none").group_by("step").agg(pl.col("entry/neg_loss_frac").mean()).sort("step")
    )
    np.testing.assert_allclose(none_neg.y, expect["entry/neg_loss_frac"].to_numpy())
    one_panel = plots.entry_loss_sign(metrics.drop("entry/neg_loss_frac"))
    assert all(d.yaxis in (None, "y") for d in one_panel.data)


def test_argmax_clipped_and_grad_cos(metrics):
    a = plots.argmax_clipped(metrics)
    assert a.layout.yaxis.tickformat == ".0%"
    g = plots.grad_cos(metrics)
    assert tuple(g.layout.yaxis.range) == (-1.05, 1.05)
    upd = next(d for d in g.data if d.name == "scaled (mean of 3)" and d.xaxis == "x")
    assert set(upd.y) == {1.0}  # the scaled update is parallel to the true gradient
    # nulls (a metric not logged every step) are dropped, not plotted as zeros
    m = metrics.filter(pl.col("seed") == 0).with_columns(
        pl.when(pl.col("step") % 2 == 0).then(None).otherwise(pl.col("entry/grad_cos")).alias("entry/grad_cos")
    )
    d = next(d for d in plots.grad_cos(m).data if d.xaxis == "x2")
    assert all(x % 2 == 1 for x in d.x)


def test_by_kl_band_means():
    pos = pl.DataFrame(
        {
            "clip": ["entry"] * 6 + ["none"] * 6,
            "step": [1, 1, 1, 2, 2, 2] * 2,
            "kl/true": [0.01, 0.02, 0.5, 0.01, 0.5, 2.0] * 2,
            "entry/grad_cos": [0.9, 0.7, 0.1, 0.8, 0.3, -0.5] * 2,
        }
    )
    fig = plots.by_kl_band(pos, edges=(0, 0.05, 1.0), step_window=2, min_count=1)
    low = next(d for d in fig.data if d.name == "KL 0–0.05" and d.xaxis == "x")
    mid = next(d for d in fig.data if d.name == "KL 0.05–1" and d.xaxis == "x")
    high = next(d for d in fig.data if d.name == "KL ≥ 1" and d.xaxis == "x")
    assert low.y[0] == pytest.approx(0.8) and mid.y[0] == pytest.approx(0.2) and high.y[0] == pytest.approx(-0.5)
    assert {d.xaxis for d in fig.data} == {"x", "x2"}
    with pytest.raises(ValueError, match="entry/grad_cos"):
        plots.by_kl_band(pos.drop("entry/grad_cos"))


def test_argmax_clipped_vs_tau():
    f = pl.DataFrame(
        {
            "tau": [0.2, 0.01, 0.05, 0.05],
            "entry/argmax_clipped_frac": [0.01, 0.3, 0.1, 0.2],
            "entry/clipped_teacher_mass": [0.02, 0.5, 0.2, 0.3],
        }
    )
    fig = plots.argmax_clipped_vs_tau(f)
    assert fig.layout.xaxis.type == "log"
    arg = fig.data[0]
    assert list(arg.x) == [0.01, 0.05, 0.2]  # sorted, duplicates averaged
    np.testing.assert_allclose(arg.y, [0.3, 0.15, 0.01])
    assert len(plots.argmax_clipped_vs_tau(f.drop("entry/clipped_teacher_mass")).data) == 1
    by = plots.argmax_clipped_vs_tau(f.with_columns(clip=pl.Series(["entry", "entry", "token", "token"])), by="clip")
    assert {d.line.color for d in by.data} == {CLIP_COLORS["entry"], CLIP_COLORS["token"]}


def test_clipped_mass_vs_divergence_bins():
    kl = np.array([0.0, 1e-3, 1e-3, 1e-2, 1e-1, 1.0, 1.0])
    mass = np.array([0.0, 0.0, 0.2, 0.1, 0.4, 0.8, 0.6])
    arg = np.array([False, False, False, False, True, True, False])
    pos = pl.DataFrame({"kl/true": kl, "entry/clipped_teacher_mass": mass, "entry/argmax_clipped": arg})
    fig = plots.clipped_mass_vs_divergence(pos, bins=3)
    mean, frac = fig.data[1], fig.data[2]
    # log bins over [1e-3, 1]: edges 1e-3, 1e-2, 1e-1, 1 -> bins {1e-3,1e-3}, {1e-2}, {1e-1,1,1}
    np.testing.assert_allclose(mean.y, [0.1, 0.1, 0.6])
    np.testing.assert_allclose(frac.y, [0, 0, 2 / 3])
    assert list(mean.customdata) == [2, 1, 3]
    assert "1 with true KL ≤ 0 left out" in fig.layout.title.text
    assert fig.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="kl/true > 0"):
        plots.clipped_mass_vs_divergence(pos.filter(pl.col("kl/true") == 0))


def test_accuracy_band_is_the_95_t_interval_over_seeds():
    s = plots.synthetic_eval_summary(steps=(0, 50), seeds=(0, 1, 2))
    fig = plots.accuracy(s)
    sc = next(d for d in fig.data if d.name == "scaled")
    band = next(d for d in fig.data if d.name == "scaled 95% interval")
    vals = s.filter(pl.col("clip") == "scaled", pl.col("step") == 50)["acc"].to_numpy()
    half = 4.3027 * vals.std(ddof=1) / np.sqrt(3)  # t(0.975, 2)
    assert sc.y[1] == pytest.approx(vals.mean())
    assert sc.customdata[1][0] == pytest.approx(half, rel=1e-3)
    assert band.y[1] == pytest.approx(vals.mean() + half, rel=1e-3)
    one = plots.accuracy(s.filter(pl.col("seed") == 0))
    assert len(one.data) == 4 and all(
        d.customdata[i][0] == 0.0 for d in one.data for i in range(2)
    )  # one seed: no band
    avg = plots.accuracy(s.rename({"acc": "avg_at_k"}))  # the summarize_eval column works too
    assert "avg_at_k" in avg.layout.yaxis.title.text


def test_seed_interval_t_quantiles():
    for df, t in ((1, 12.706), (2, 4.303), (3, 3.182), (9, 2.262), (29, 2.045)):
        assert plots.t_quantile(df) == pytest.approx(t, abs=2e-3)
    si = plots.seed_interval([1.0, 2.0, 3.0, 4.0])
    assert si["lo"] == pytest.approx(2.5 - 3.182 * np.std([1, 2, 3, 4], ddof=1) / 2, abs=2e-3)


@pytest.mark.parametrize(
    "fn,col",
    [
        (plots.kl_drift, "kl/true"),
        (plots.loss_by_clip, "loss"),
        (plots.entry_loss_sign, "entry/loss"),
        (plots.argmax_clipped, "entry/argmax_clipped_frac"),
        (plots.grad_cos, "update_cos"),
    ],
)
def test_missing_columns_are_named(metrics, fn, col):
    drop = [col, "entry/grad_cos"] if col == "update_cos" else [col]
    with pytest.raises(ValueError, match=col):
        fn(metrics.drop(drop))
    with pytest.raises(ValueError, match="empty"):
        fn(metrics.head(0))


def test_plots_never_touch_disk(metrics, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (
        plots.kl_drift(metrics),
        plots.loss_by_clip(metrics),
        plots.entry_loss_sign(metrics),
        plots.accuracy(plots.synthetic_eval_summary()),
    )
    plots.clipped_mass_vs_divergence(plots.synthetic_positions(500))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- report
# ---------------------------------------------------------------- figures saved in notebooks: one compressed PNG
def _encode_ref(px, filters):
    "Reference PNG encoder written from the PNG spec: each line filtered by its formula (0 None .. 4 Paeth), zlib."
    import zlib

    h, w, ch = px.shape
    lines, prev = [], np.zeros(w * ch, int)
    for y in range(h):
        cur, f = px[y].reshape(-1).astype(int), filters[y % len(filters)]
        left = np.r_[np.zeros(ch, int), cur[:-ch]]
        upleft = np.r_[np.zeros(ch, int), prev[:-ch]]
        p = left + prev - upleft
        paeth = np.where(
            (abs(p - left) <= abs(p - prev)) & (abs(p - left) <= abs(p - upleft)),
            left,
            np.where(abs(p - prev) <= abs(p - upleft), prev, upleft),
        )
        pred = [0 * cur, left, prev, (left + prev) // 2, paeth][f]
        lines.append(bytes([f]) + ((cur - pred) % 256).astype(np.uint8).tobytes())
        prev = cur
    ihdr = struct.pack(">IIBBBBB", w, h, 8, {1: 0, 2: 4, 3: 2, 4: 6}[ch], 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + plots._png_chunk(b"IHDR", ihdr)
        + plots._png_chunk(b"IDAT", zlib.compress(b"".join(lines)))
        + plots._png_chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 5, 1), (13, 11, 3), (6, 41, 4), (9, 3, 2)])
def test_png_pixels_undo_every_filter(shape):
    "Breaks seen failing: the Up filter adding the line above twice; Paeth preferring `b` on ties."
    rng = np.random.default_rng(sum(shape))
    img = rng.integers(0, 256, size=shape, dtype=np.uint8)
    for filters in ([0], [1], [2], [3], [4], [4, 3, 2, 1, 0]):
        np.testing.assert_array_equal(plots.png_pixels(_encode_ref(img, filters)), img)
    with pytest.raises(ValueError, match="not a PNG"):
        plots.png_pixels(b"GIF89a....")


def test_compress_png_exact_below_256_colours_else_nearest():
    "Indexed output; exact with <= 256 colours, else every pixel the nearest of the most frequent colours."
    rng = np.random.default_rng(1)
    few = rng.integers(0, 256, size=(200, 3), dtype=np.uint8)[rng.integers(0, 200, size=(30, 40))]
    opaque = np.concatenate([few, np.full((30, 40, 1), 255, np.uint8)], 2)
    small = plots.compress_png(_encode_ref(opaque, [2]))
    assert small[25] == 3  # colour type 3
    np.testing.assert_array_equal(plots.png_pixels(small), few)
    many = rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    many[:10] = many[0, 0]  # one dominant colour
    got = plots.png_pixels(plots.compress_png(_encode_ref(many, [0]), colors=8)).reshape(-1, 3).astype(int)
    keys, counts = np.unique(many.reshape(-1, 3), axis=0, return_counts=True)
    pal = keys[np.argsort(-counts, kind="stable")[:8]].astype(int)
    flat = many.reshape(-1, 3).astype(int)
    best = ((flat[:, None] - pal[None]) ** 2).sum(-1).min(1)
    np.testing.assert_array_equal(((got - flat) ** 2).sum(1), best)
    assert {tuple(c) for c in got} <= {tuple(c) for c in pal}
    transparent = opaque.copy()
    transparent[0, 0, 3] = 0
    png = _encode_ref(transparent, [1])
    assert plots.compress_png(png) == png  # alpha is kept by keeping the file


def test_kaleido_ok_without_a_browser_does_not_start_kaleido(monkeypatch):
    """With no Chrome/Chromium found, `kaleido_ok` answers False without starting kaleido's server: started without a
    browser, that server waited forever and hung `nbdev_test` (seen on a fresh machine where dev.sh had not installed
    chromium). Break that made it fail: the `find_chrome()` check removed from `kaleido_ok`."""
    import kaleido
    started = []
    monkeypatch.setattr(plots, "find_chrome", lambda: None)
    monkeypatch.setattr(plots, "_KALEIDO_OK", None)
    monkeypatch.setattr(kaleido, "start_sync_server", lambda *a, **k: started.append(1))
    assert plots.kaleido_ok() is False and started == []


@pytest.mark.skipif(plots.find_chrome() is None, reason="no Chrome/Chromium for kaleido")
def test_notebook_figures_saves_one_small_png(metrics):
    "A figure displays as ONE indexed PNG (no plotly JSON), close to kaleido's own PNG and several times smaller."
    import base64
    import plotly.io as pio

    old = pio.renderers.default
    try:
        assert plots.notebook_figures() == "png"
        fig = plots.kl_drift(metrics)
        bundle = pio.renderers._build_mime_bundle(fig.to_dict())
        assert set(bundle) == {"image/png"}
        png = base64.b64decode(bundle["image/png"])
        ref = pio.to_image(fig, format="png", width=800, height=fig.layout.height or 450)
        a, b = plots.png_pixels(png).astype(int), plots.png_pixels(ref)[..., :3].astype(int)
        assert a.shape == b.shape and png[25] == 3
        assert np.abs(a - b).mean() < 1.0 and (a == b).all(-1).mean() > 0.9, (
            np.abs(a - b).mean(),
            (a == b).all(-1).mean(),
        )
        assert len(png) * 2.5 < len(ref), (len(png), len(ref))
    finally:
        pio.renderers.default = old


def _eval_rows(metrics, steps=(0, 20), n=10, k=2):
    rng = np.random.default_rng(0)
    rows = []
    for run in metrics["run"].unique().sort():
        for step in steps:
            for i in range(n):
                for j in range(k):
                    ok = bool(rng.random() < 0.5)
                    rows.append(
                        dict(
                            run=run,
                            step=step,
                            seed=0,
                            split="test",
                            problem_id=str(i),
                            sample=j,
                            correct=ok,
                            pred="1" if ok else "2",
                            answer="1",
                        )
                    )
    return pl.DataFrame(rows)


def _is_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


HAVE_CHROME = plots.find_chrome() is not None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    m = plots.synthetic_metrics(steps=15, seeds=(0, 1), clips=("entry", "scaled"))
    ev = _eval_rows(m)
    pos = plots.synthetic_positions(800).with_columns(pl.lit("entry-s0").alias("run"))
    cfgs = {r: dict(name=r, clip=r.split("-")[0], tau=0.05) for r in m["run"].unique().sort()}
    out = tmp_path_factory.mktemp("rep") / "report"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        index = report.report_from_frames(m, ev, pos, cfgs, out, title="test report", png=True)
    return dict(index=index, metrics=m, evals=ev, warnings=[str(x.message) for x in w], out=out)


def test_report_html_is_self_contained(built):
    index = built["index"]
    assert index.name == "index.html" and index.exists()
    page = index.read_text()
    assert page.count("* plotly.js v") == 1  # the bundle inlined exactly once
    assert re.search(r"<script[^>]+src=[\"']https?:", page) is None  # nothing from the network
    assert "mathjax" not in page.lower() or "cdnjs" not in page
    names = list(
        report.report_figures(
            built["metrics"],
            built["evals"],
            plots.synthetic_positions(800).with_columns(pl.lit("entry-s0").alias("run")),
        )
    )
    assert names == list(REPORT_FIGURES)
    for name in names:
        assert f'id="fig-{name}"' in page, name
    assert page.count("Plotly.newPlot") == len(names)
    for run in built["metrics"]["run"].unique():
        assert f"<summary>{run}</summary>" in page  # its config


def test_report_table_numbers_come_from_the_frames(built):
    t = report.run_summary(built["metrics"], built["evals"])
    m = built["metrics"].filter(pl.col("run") == "scaled-s1").sort("step")
    r = t.filter(pl.col("run") == "scaled-s1").row(0, named=True)
    assert r["kl_true_first"] == m["kl/true"][0] and r["kl_true_last"] == m["kl/true"][-1]
    assert r["loss_last"] == m["loss"][-1] and r["entry_argmax_clipped_last"] == m["entry/argmax_clipped_frac"][-1]
    e = built["evals"].filter(pl.col("run") == "scaled-s1")
    assert r["acc_first"] == pytest.approx(e.filter(pl.col("step") == 0)["correct"].mean())
    assert r["acc_last"] == pytest.approx(e.filter(pl.col("step") == 20)["correct"].mean())
    page = built["index"].read_text()
    assert f"{m['kl/true'][0]:.4g} → {m['kl/true'][-1]:.4g}" in page


@pytest.mark.skipif(not HAVE_CHROME, reason="no Chrome/Chromium for kaleido")
def test_report_pngs(built):
    pngs = sorted((built["out"] / "figures").glob("*.png"))
    assert [p.stem for p in pngs] == sorted(REPORT_FIGURES)
    for p in pngs:
        w, h = _is_png(p)
        assert w >= 1000 and h >= 400, (p, w, h)
        assert p.stat().st_size > 20_000, p  # a real plot, not a blank image
    assert not any("PNGs not written" in m for m in built["warnings"])


@pytest.mark.skipif(not shutil.which("chromium"), reason="no chromium binary")
def test_report_renders_offline_in_chromium(built):
    # headless Chromium with the network off: every figure must become an SVG plot
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--proxy-server=127.0.0.1:9",
                "--virtual-time-budget=8000",
                "--dump-dom",
                built["index"].as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    rendered = set(re.findall(r'id="fig-([^"]+)"[^>]*class="[^"]*js-plotly-plot', dom))
    rendered |= set(re.findall(r'class="[^"]*js-plotly-plot[^"]*"[^>]*id="fig-([^"]+)"', dom))
    assert len(rendered) == 9, rendered
    assert dom.count('class="main-svg"') >= 9


def test_report_without_chrome_warns_and_still_writes_html(tmp_path, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chrome"))
    m = plots.synthetic_metrics(steps=5, seeds=(0,), clips=("entry",))
    with pytest.warns(UserWarning, match="PNGs not written"):
        index = report.report_from_frames(m, out_dir=tmp_path / "r", png=True)
    page = index.read_text()
    assert 'id="fig-kl_drift"' in page and "PNG copies were not written" in page
    assert not (tmp_path / "r" / "figures").exists() or not list((tmp_path / "r" / "figures").glob("*.png"))


def test_report_png_false_and_bad_input(tmp_path):
    m = plots.synthetic_metrics(steps=5, seeds=(0,), clips=("token",))
    index = report.report_from_frames(m, out_dir=tmp_path / "r", png=False)
    assert index.exists() and not (tmp_path / "r" / "figures").exists()
    with pytest.raises(ValueError, match="run"):
        report.report_from_frames(m.drop("run"), out_dir=tmp_path / "r2", png=False)
    with pytest.raises(ValueError, match="step"):
        report.run_summary(m, pl.DataFrame(dict(run=["token-s0"], problem_id=["0"], pred=["1"], correct=[True])))


def _write_run_dir(root: Path, name: str, clip: str, steps=6, positions="jsonl"):
    d = root / name
    d.mkdir(parents=True)
    m = plots.synthetic_metrics(steps=steps, seeds=(0,), clips=(clip,)).with_columns(pl.lit(name).alias("run"))
    (d / "config.json").write_text(json.dumps(dict(name=name, clip=clip, tau=0.05)))
    with open(d / "metrics.jsonl", "w") as f:
        for r in m.iter_rows(named=True):
            f.write(json.dumps(r) + "\n")
    with open(d / "eval.jsonl", "w") as f:
        for step in (0, steps):
            for i in range(4):
                f.write(
                    json.dumps(
                        dict(
                            run=name,
                            step=step,
                            seed=0,
                            split="test",
                            problem_id=str(i),
                            sample=0,
                            correct=bool(i % 2),
                            pred=str(i % 2),
                            answer="1",
                        )
                    )
                    + "\n"
                )
    pos = plots.synthetic_positions(300).drop("run", "clip", "step")
    if positions == "jsonl":  # what opsd.train writes
        with open(d / "positions.jsonl", "w") as f:
            for r in pos.iter_rows(named=True):
                f.write(json.dumps(dict(run=name, step=1, clip=clip, **r)) + "\n")
    else:
        pos.write_parquet(d / "positions.parquet")
    return d


def test_write_report_from_run_folders(tmp_path):
    dirs = [
        _write_run_dir(tmp_path / "runs", "a", "entry"),
        _write_run_dir(tmp_path / "runs", "b", "scaled", positions="parquet"),
    ]
    index = report.write_report(dirs, tmp_path / "rep", title="two runs", png=False)
    page = index.read_text()
    for fig in ("kl_drift", "loss_by_clip", "accuracy_test", "clipped_mass_entry", "clipped_mass_scaled"):
        assert f'id="fig-{fig}"' in page, fig
    assert "<summary>a</summary>" in page and "<summary>b</summary>" in page
    table = report.run_summary(
        *[pl.concat([report.load_run(d)[i] for d in dirs], how="diagonal_relaxed") for i in (0, 1)]
    )
    assert table["run"].to_list() == ["a", "b"] and table["steps"].to_list() == [6, 6]
    assert table["acc_last"].to_list() == [0.5, 0.5]
    with pytest.raises(ValueError, match="not a run folder"):
        report.write_report([tmp_path / "missing"], tmp_path / "rep2", png=False)


def test_report_of_a_real_training_run(tiny_ckpt, toy_problems, tmp_path):
    # end to end on CPU: train the tiny real Qwen3 of conftest (2 steps), sweep its checkpoints, report from the folder
    from transformers import AutoTokenizer

    from opsd.eval import grade, sweep_checkpoints
    from opsd.rollout import SamplingConfig
    from opsd.runs import read_eval, read_metrics, read_positions

    import opsd.train as train

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    probs = toy_problems[:9]
    cfg = train.OPSDConfig(
        model=str(tiny_ckpt),
        run_dir=str(tmp_path / "runs" / "tiny"),
        clip="entry",
        lora=dict(r=4, alpha=8), sampling=dict(max_tokens=6),
        lr=1e-2,
        batch_size=4,
        micro_batch_size=4,
        steps=2,
        save_every=1,
        dtype="float32",
        log_positions=16,
    )
    run = train.OPSDTrainer(cfg, probs, grader=lambda t, a: grade(t, a, "exact"), progress=False).fit()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt).eval()
    sweep_checkpoints(
        run,
        base,
        tok,
        probs[:3],
        k=2,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=6),
        backend="hf",
        progress=False,
    )
    index = report.write_report([run], tmp_path / "report", png=False)
    page = index.read_text()
    m = read_metrics(run).sort("step")
    for name in (
        "kl_drift",
        "loss_by_clip",
        "entry_loss_sign",
        "argmax_clipped",
        "grad_cos",
        "clipped_mass_entry",
        "accuracy_test",
    ):
        assert f'id="fig-{name}"' in page, name
    assert f"{m['kl/true'][0]:.4g} → {m['kl/true'][-1]:.4g}" in page  # the table's numbers are the log's
    figs = report.report_figures(m, read_eval(run), read_positions(run))
    assert list(figs["kl_drift"][1].data[0].y) == m["kl/true"].to_list()
    assert (m["loss"] - m["entry/loss"]).abs().max() < 1e-5  # an entry run's own loss IS the released loss
    ev = read_eval(run)
    assert sorted(set(ev["step"].to_list())) == [0, 1, 2]
    acc = next(d for d in figs["accuracy_test"][1].data if d.mode == "lines+markers")
    assert list(acc.y) == pytest.approx([ev.filter(pl.col("step") == s)["correct"].mean() for s in (0, 1, 2)])


def test_report_keeps_real_runs_that_share_a_name_apart(tiny_ckpt, toy_problems, tmp_path, capsys):
    """Two real `opsd.train` runs in sweep/lr1/run and sweep/lr2/run (both named 'run' by their folders): the report
    shows two runs, labelled lr1/run and lr2/run, each with its own 2 steps and its own true KL, and says so.
    Break: write_report without the relabelling (labels = names) -> one row 'run' with 4 steps, one config."""
    import torch
    from opsd.train import OPSDConfig, OPSDTrainer
    from opsd.runs import read_metrics

    torch.set_num_threads(1)
    dirs = []
    for sub, clip, lr in (("lr1", "entry", 1e-2), ("lr2", "none", 5e-2)):
        cfg = OPSDConfig(model=str(tiny_ckpt), run_dir=str(tmp_path / "sweep" / sub / "run"), clip=clip, lr=lr,
                         lora=dict(r=2, alpha=4), sampling=dict(max_tokens=6), batch_size=2, micro_batch_size=2,
                         steps=2, save_every=2,
                         dtype="float32", seed=0)
        dirs.append(OPSDTrainer(cfg, toy_problems[:8], progress=False).fit())
    ms = [read_metrics(d) for d in dirs]
    assert set(ms[0]["run"]) == set(ms[1]["run"]) == {"run"}  # the trainer names both after their folder
    index = report.write_report(dirs, tmp_path / "rep", png=False)
    page = index.read_text()
    assert "<summary>lr1/run</summary>" in page and "<summary>lr2/run</summary>" in page
    assert "'run' names 2 run folders, shown as lr1/run, lr2/run" in capsys.readouterr().out
    assert "Runs that share a name" in page
    loaded = [report.load_run(d) for d in dirs]
    labels = report.unique_run_labels([m["run"][0] for m, *_ in loaded], dirs)
    assert labels == ["lr1/run", "lr2/run"]
    table = report.run_summary(pl.concat([m.with_columns(pl.lit(lab).alias("run")) for (m, *_), lab
                                          in zip(loaded, labels)], how="diagonal_relaxed"))
    assert table["run"].to_list() == labels and table["steps"].to_list() == [2, 2]
    for m, row in zip(ms, table.iter_rows(named=True)):  # each row is its own run's log, not a merge
        assert row["clip"] == m["clip"][0] and row["kl_true_last"] == m["kl/true"][-1]
    assert f"{ms[0]['kl/true'][0]:.4g} → {ms[0]['kl/true'][-1]:.4g}" in page
    assert f"{ms[1]['kl/true'][0]:.4g} → {ms[1]['kl/true'][-1]:.4g}" in page
    with pytest.raises(ValueError, match="given more than once"):
        report.write_report([dirs[0], dirs[0]], tmp_path / "rep2", png=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile: is a file"):
        report.write_report(dirs, tmp_path / "afile", png=False)


def test_report_says_how_old_the_trained_completions_were():
    """A run trained on completions from earlier weights (`steps_per_rollout`, `async_rollout`: the metrics'
    `rollout_age`) gets its mean age in the summary table; runs that are all on-policy (or logged before the column
    existed) get no such column. Break that made it fail: the age's max instead of its mean (1 instead of 0.5)."""
    m = pl.DataFrame(dict(run=["k2"] * 4 + ["k1"] * 4 + ["old"] * 4, step=[1, 2, 3, 4] * 3, clip=["scaled"] * 12,
                          loss=[0.1] * 12, rollout_age=[0, 1, 0, 1] + [0] * 4 + [None] * 4))
    t = report.run_summary(m)
    assert dict(zip(t["run"], t["rollout_age"])) == {"k2": 0.5, "k1": 0.0, "old": None}
    page = report._table_html(t)
    assert "mean rollout age" in page and '<td class="">0.5</td>' in page
    assert "mean rollout age" not in report._table_html(report.run_summary(m.filter(pl.col("run") != "k2")))
