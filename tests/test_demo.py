"""Tests of opsd.demo: a real (tiny) demo over 2 seeds x 2 clips on a reduced toy, its per-seed effects and the
intervals over seeds; the summary maths on hand-made frames; the argument parsing."""
import argparse
import math

import numpy as np
import polars as pl
import pytest
import torch

from opsd import demo
from opsd.plots import seed_interval

torch.set_num_threads(1)

SMALL_TOY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, sft_steps=20, warmup_steps=2, batch_size=8, n_eval=0, max_new_tokens=16)


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the toy base cache of this test only
    recipe = demo.DemoRecipe(steps=2, batch_size=4, save_every=1, n_eval=8, k=2, log_positions=4)
    res = demo.run_demo(root / "demo", clips=("entry", "none"), seeds=2, recipe=recipe, workers=2, toy=SMALL_TOY,
                        report=True, png=False, max_completion_length=16)
    yield root / "demo", res
    mp.undo()


def test_demo_writes_every_seed_and_cell(tiny_demo):
    out, res = tiny_demo
    names = sorted(d.name for d in out.iterdir() if (d / "config.json").exists())
    assert names == ["soft-entry-s0", "soft-entry-s1", "soft-none-s0", "soft-none-s1"]
    m, ev, pos = demo.demo_frames(out)
    assert sorted(m["step"].unique().to_list()) == [1, 2] and set(m["seed"].to_list()) == {0, 1}
    assert sorted(ev["step"].unique().to_list()) == [0, 1, 2]  # the base (step 0) and every checkpoint
    assert ev.group_by("run", "step").len()["len"].unique().to_list() == [16]  # 8 problems x k=2
    # every run of a cell starts from the same base: identical step-0 evaluations
    s0 = ev.filter(pl.col("step") == 0).sort("run", "problem_id", "sample")
    assert len({tuple(g["correct"].to_list()) for _, g in s0.group_by("run")}) == 1
    none = m.filter(pl.col("clip") == "none")
    assert (none["loss"] >= 0).all()  # a KL, whatever the entry instruments say
    assert (out / "summary.csv").exists() and (out / "effects.csv").exists()
    page = (out / "report-soft" / "index.html").read_text()
    assert "Per clip mode over seeds" in page and 'id="fig-accuracy_test"' in page


def test_effects_are_the_runs_numbers(tiny_demo):
    out, res = tiny_demo
    m, ev, _ = demo.demo_frames(out)
    fx = res["effects"].sort("run")
    for r in fx.iter_rows(named=True):
        e = ev.filter(pl.col("run") == r["run"])
        acc = lambda s: e.filter(pl.col("step") == s)["correct"].mean()
        assert r["acc_change"] == pytest.approx(acc(2) - acc(0))
        g = m.filter(pl.col("run") == r["run"]).sort("step")
        assert r["kl_change"] == pytest.approx(g["kl/true"][-1] - g["kl/true"][0])  # window = 1 step of 2
    t = res["table"].filter(pl.col("clip") == "entry", pl.col("effect") == "acc_change").row(0, named=True)
    vals = fx.filter(pl.col("clip") == "entry")["acc_change"].to_list()
    s = seed_interval(vals)
    assert t["n"] == 2 and t["mean"] == pytest.approx(np.mean(vals)) and t["lo"] == pytest.approx(s["lo"])
    assert "held-out acc change" in res["text"] and "n = 2 seeds" in res["text"]


def test_effect_table_and_format_on_hand_made_rows():
    fx = pl.DataFrame({"teacher": "copy", "clip": ["scaled"] * 3, "seed": [0, 1, 2], "acc_change": [0.10, 0.12, 0.14],
                       "kl_change": [-0.01, -0.02, -0.03]})
    t = demo.effect_table(fx)
    a = t.filter(pl.col("effect") == "acc_change").row(0, named=True)
    assert a["mean"] == pytest.approx(0.12) and a["sd"] == pytest.approx(0.02)
    assert a["lo"] == pytest.approx(0.12 - 4.3027 * 0.02 / math.sqrt(3), abs=1e-4)
    text = demo.format_effects(t)
    assert "+12.0 ± 2.0 [+7.0, +17.0] * pts" in text  # excludes zero: starred
    assert "true KL change" in text and "acc_best_change" not in text


def test_seed_effects_need_the_keys():
    with pytest.raises(ValueError, match="kl/true"):
        demo.seed_effects(pl.DataFrame({"run": ["a"], "step": [1], "loss": [0.1]}), None)


def test_demo_jobs_and_args(tmp_path):
    jobs = demo.demo_jobs(tmp_path, teachers=("copy", "soft"), clips=("entry",), seeds=[3, 5])
    assert [j["name"] for j in jobs] == ["copy-entry-s3", "soft-entry-s3", "copy-entry-s5", "soft-entry-s5"]
    cfg = demo.job_config(jobs[1])
    assert (cfg.model, cfg.clip, cfg.seed, cfg.padding, cfg.steps) == ("toy:soft", "entry", 3, "aligned", demo.DemoRecipe().steps)
    a = demo.add_demo_args(argparse.ArgumentParser()).parse_args(["--seeds", "4", "--clips", "scaled", "--study", "schedules"])
    assert (a.seeds, a.clips, a.study) == (4, ["scaled"], "schedules")
    with pytest.raises(FileNotFoundError, match="no run folders"):
        demo.demo_frames(tmp_path / "nothing")
