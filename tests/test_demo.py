"""Tests of opsd.demo: a real (tiny) demo over 2 seeds x 2 clips on a reduced toy, its per-seed effects and the
intervals over seeds; the summary maths on hand-made frames; the argument parsing."""
import argparse
import json
import math

import numpy as np
import polars as pl
import pytest

from conftest import opsd_main
from opsd import demo
from opsd.plots import seed_interval

SMALL_TOY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, sft_steps=20, warmup_steps=2, batch_size=8, n_eval=0,
                 max_new_tokens=16)


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    "The reduced demo of nbs/10b_demo (run here, not in the notebook), counting this process's hashes of base weights."
    import opsd.repro
    root = tmp_path_factory.mktemp("demo")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the toy base cache of this test only
    hashed, hash_of = [], opsd.repro._hash_weights
    mp.setattr(opsd.repro, "_hash_weights", lambda files: hashed.append(files[0].parent.name) or hash_of(files))
    recipe = demo.DemoRecipe(dict(steps=2, batch_size=4, save_every=1, log_positions=4), n_eval=8, k=2)
    try:
        res = demo.run_demo(root / "demo", clips=("entry", "none"), seeds=2, recipe=recipe, workers=2, toy=SMALL_TOY,
                            report=True, png=False, sampling=dict(max_tokens=16))
    finally:
        mp.undo()
    yield root / "demo", dict(res, hashed=hashed, cache=root / "cache")


def test_demo_hashes_its_base_once(tiny_demo, monkeypatch):
    """The new toy base is hashed once in this process, and the fingerprint demo.json records is its build's.
    Break that made it fail: run_demo hashing the base again (2)."""
    from opsd.toy import toy_base_path, toy_build_info, toy_config
    out, res = tiny_demo
    monkeypatch.setenv("XDG_CACHE_HOME", str(res["cache"]))
    base = toy_base_path(toy_config("soft", **SMALL_TOY), "soft")
    assert res["hashed"].count(base.name) == 1
    assert json.loads((out / "demo.json").read_text())["toy_bases"] == {"soft": toy_build_info(base)["fingerprint"]}


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
    assert "Effects per clip mode over seeds" in page and 'id="fig-accuracy_test"' in page


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
    assert (cfg.model, cfg.clip, cfg.seed, cfg.padding, cfg.steps) == ("toy:soft", "entry", 3, "aligned", 100)
    args = ["--seeds", "4", "--clips", "scaled", "--study", "schedules"]
    a = demo.add_demo_args(argparse.ArgumentParser()).parse_args(args)
    assert (a.seeds, a.clips, a.study) == (4, ["scaled"], "schedules")
    with pytest.raises(FileNotFoundError, match="no run folders"):
        demo.demo_frames(tmp_path / "nothing")


def test_toy_demo_config_is_unchanged():
    """The toy demo's run config, written out by hand: the released toy preset plus the demo's lr and aligned padding.
    Break: DEMO_TOY's lr changed, or micro_batch_size no longer following batch_size -> the dicts differ."""
    from opsd.train import OPSDConfig
    job = demo.demo_jobs("runs/demo", clips=("scaled",), seeds=[2])[0]
    by_hand = OPSDConfig.toy(model="toy:soft", run_dir="runs/demo/soft-scaled-s2", name="soft-scaled-s2", clip="scaled",
                             seed=2, steps=100, lr=3e-3, scheduler="linear", batch_size=32, micro_batch_size=32,
                             lora=dict(r=8, alpha=16), max_grad_norm=1.0, save_every=25, log_positions=64,
                             padding="aligned")
    assert demo.job_config(job).to_dict() == by_hand.to_dict()
    assert (job["recipe"]["n_eval"], job["recipe"]["k"], job["recipe"]["eval_seed"]) == (200, 2, 0)
    small = demo.job_config(demo.demo_jobs("x", seeds=1, recipe=demo.DemoRecipe(dict(batch_size=8)))[0])
    assert (small.batch_size, small.micro_batch_size) == (8, 8)


def test_demo_recipe_holds_no_config_fields():
    "DemoRecipe holds OPSDConfig overrides in one dict, not copies of the config's fields."
    import dataclasses
    from opsd.train import OPSDConfig
    mine = {f.name for f in dataclasses.fields(demo.DemoRecipe)}
    assert not mine & {f.name for f in dataclasses.fields(OPSDConfig)}, mine
    with pytest.raises(ValueError, match="learning_rate"):
        demo.DemoRecipe(dict(learning_rate=1e-3))
    r = demo.DemoRecipe(dict(lr=1e-3)).with_config(scheduler="cosine")
    assert r.config == {"lr": 1e-3, "scheduler": "cosine"}
    labels = [(lab, c) for lab, c, _ in demo.released_lr_variants()]
    assert labels == [("lr0.0003", "entry"), ("lr0.0003", "scaled"), ("lr0.003", "entry")]


# -- a world that is not the toy: runs in sequence, one shared rollout engine (HF on this CPU) --

@pytest.fixture(scope="module")
def world_demo(tiny_ckpt, toy_data_file, tmp_path_factory):
    "`opsd demo --model PATH --data FILE` in this process (conftest.opsd_main), counting the rollout engines it makes."
    import opsd.rollout
    import opsd.train
    out = tmp_path_factory.mktemp("wdemo") / "demo"
    made, results = [], []
    real, real_demo = opsd.rollout.make_rollout, demo.run_demo
    mp = pytest.MonkeyPatch()
    spy = lambda *a, **k: made.append(a[0]) or real(*a, **k)  # a counting spy: every engine made, wherever
    mp.setattr(opsd.rollout, "make_rollout", spy)
    mp.setattr(opsd.train, "make_rollout", spy)  # the trainer's own engine factory (imported by name)
    mp.setattr(demo, "run_demo", lambda *a, **k: results.append(real_demo(*a, **k)) or results[-1])  # keeps its return
    try:
        code, stdout, err = opsd_main(
            "demo", "--model", tiny_ckpt, "--data", toy_data_file, "--seeds", 2, "--clips", "entry", "none", "--steps", 2,
            "--n-eval", 6, "--k", 1, "--out", out, "--no-png", "--set", "batch_size=4", "micro_batch_size=4",
            "lora.r=4",
            "lora.alpha=8", "sampling.max_tokens=12", "log_positions=4", "dtype=float32", "rollout=hf", "lr=0.01")
    finally:
        mp.undo()
    assert code == 0, err[-3000:]
    return out, results[0], made, stdout


def test_world_demo_shares_one_engine(world_demo, tiny_ckpt):
    "Break: run_world_jobs not passing rollout=engine to the trainers (each builds its own) -> 4 engines, not 1."
    out, res, made, stdout = world_demo
    assert made == ["hf"]  # one engine for 4 runs and their evaluations
    names = sorted(d.name for d in out.iterdir() if (d / "config.json").exists())
    assert names == ["tiny-qwen3-entry-s0", "tiny-qwen3-entry-s1", "tiny-qwen3-none-s0", "tiny-qwen3-none-s1"]
    assert "in sequence, one rollout engine" in stdout and "tiny-qwen3-entry-s1: train" in stdout
    m, ev, _ = demo.demo_frames(out)
    assert set(m["teacher"]) == {"tiny-qwen3"} and sorted(ev["step"].unique().to_list()) == [0, 1, 2]
    s0 = ev.filter(pl.col("step") == 0).sort("run", "problem_id")  # every run starts from the same base
    assert len({tuple(g["pred"].to_list()) for _, g in s0.group_by("run")}) == 1
    assert res["effects"].height == 4 and {t["name"] for t in res["timing"]} == set(names)
    assert all(t["train_s"] > 0 and t["eval_s"] > 0 for t in res["timing"])
    assert pl.read_csv(out / "summary.csv").height >= 1 and (out / "report-tiny-qwen3" / "index.html").exists()


def test_world_demo_evaluates_with_the_worlds_sampling(tiny_ckpt, toy_data_file, tmp_path, monkeypatch):
    """`run_world_jobs` evaluates with the world's `eval_sampling` (SmolLM2's is greedy; a path world's, patched greedy
    here). Break that made it fail: the demo building `default_eval_sampling` itself (rows at temperature 1.0)."""
    from opsd.rollout import SamplingConfig
    from opsd.worlds import World
    monkeypatch.setattr(World, "eval_sampling", lambda self, seed=0, max_new_tokens=None:
                        SamplingConfig(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed))
    recipe = demo.DemoRecipe(dict(steps=1, batch_size=2, micro_batch_size=2, save_every=1, lora=dict(r=2, alpha=4),
                                  sampling=dict(max_tokens=8), log_positions=0, dtype="float32", rollout="hf"),
                             n_eval=3, k=1)
    demo.run_demo(tmp_path / "g", clips=("entry",), seeds=1, recipe=recipe, world=str(tiny_ckpt),
                  data=str(toy_data_file), report=False, png=False, progress=False)
    ev = pl.read_ndjson(tmp_path / "g" / "tiny-qwen3-entry-s0" / "eval.jsonl")
    assert sorted(ev["step"].unique().to_list()) == [0, 1]
    assert (ev["key_temperature"].unique().to_list(), ev["key_top_p"].unique().to_list()) == ([0.0], [1.0])


def test_world_demo_runs_equal_runs_on_their_own(world_demo, tiny_ckpt, toy_data_file, tmp_path):
    """The last run, trained after three others on the shared engine, equals the same config trained alone with its own
    engine; its evaluation equals a fresh evaluation with a fresh engine.
    Break: the trainer not syncing its student into a shared engine (the engine keeps the previous run's weights) ->
    the rollouts, hence the metrics, differ; the evaluation not syncing each checkpoint -> the eval rows differ."""
    import polars as pl
    from opsd.eval import eval_runs, default_eval_sampling
    from opsd.train import OPSDConfig, OPSDTrainer
    from opsd.worlds import resolve_world
    out, res, _, _ = world_demo
    rd = out / "tiny-qwen3-none-s1"
    cfg = OPSDConfig.from_dict({**json.loads((rd / "config.json").read_text()), "run_dir": str(tmp_path / "alone")})
    w = resolve_world(str(tiny_ckpt), data=str(toy_data_file))
    OPSDTrainer(cfg, w.problems(2000, seed=1), model_path=w.path, prompt_config=w.prompt_config(), progress=False).fit()
    cols = ["step", "loss", "kl/true", "entry/argmax_clipped_frac"]
    shared = pl.read_ndjson(rd / "metrics.jsonl").select(cols)
    alone = pl.read_ndjson(tmp_path / "alone" / "metrics.jsonl").select(cols)
    assert shared.equals(alone), (shared, alone)
    eval_runs([tmp_path / "alone"], w.problems(6, seed=10_000, split="test"), model_path=w.path, k=1, backend="hf",
              max_new_tokens=12, grade_mode="math", prompt_cfg=w.prompt_config(), dtype="float32",
              sampling=default_eval_sampling(0, max_new_tokens=12), progress=False)
    key = ["step", "problem_id", "sample"]
    a = pl.read_ndjson(rd / "eval.jsonl").sort(key).select(*key, "pred", "completion_len")
    b = pl.read_ndjson(tmp_path / "alone" / "eval.jsonl").sort(key).select(*key, "pred", "completion_len")
    assert a.equals(b), (a, b)
