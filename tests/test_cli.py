"The command line: help, errors, `opsd padding`, and a reduced `opsd demo` whose saved numbers must be consistent."
import json, subprocess
from pathlib import Path

import polars as pl
import pytest

from conftest import venv_bin

OPSD = venv_bin("opsd")


def run(*args, check=True, **kw):
    return subprocess.run([OPSD, *map(str, args)], capture_output=True, text=True, check=check, timeout=1800, **kw)


@pytest.mark.parametrize("cmd", ["demo", "train", "eval", "report", "padding"])
def test_help(cmd):
    out = run(cmd, "--help").stdout
    assert "usage: opsd " + cmd in out


def test_bad_input_is_a_clear_error(tiny_ckpt, tmp_path):
    r = run("train", "--model", tiny_ckpt, "--run-dir", tmp_path / "r", check=False)
    assert r.returncode == 2 and "--data is required" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "solution": "\\\\boxed{2}", "answer": "2"}\n{"problem": "", "solution": "x", "answer": "1"}\n')
    r = run("train", "--model", tiny_ckpt, "--data", bad, "--run-dir", tmp_path / "r", check=False)
    assert r.returncode == 2 and "line 2" in r.stderr and "problem" in r.stderr, r.stderr
    r = run("train", "--model", tiny_ckpt, "--set", "learning_rate=3", check=False)
    assert r.returncode == 2 and "learning_rate" in r.stderr


def test_padding_json(tiny_ckpt, toy_problems, tmp_path):
    data = tmp_path / "p.jsonl"
    pl.DataFrame([{k: p[k] for k in ("problem", "solution", "answer")} for p in toy_problems]).write_ndjson(data)
    rep = json.loads(run("padding", "--model", tiny_ckpt, "--data", data, "--n", 8, "--json").stdout)
    flat = json.dumps(rep)
    assert "released" in flat and "aligned" in flat


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    r = run("demo", "--quick", "--seeds", "2", "--teachers", "soft", "--clips", "entry", "scaled", "none", "--out", out, "--no-png")
    return out, r.stdout


def test_quick_demo_outputs_are_consistent(quick_demo):
    out, stdout = quick_demo
    for seed in (0, 1):
        runs = {m: out / f"soft-{m}-s{seed}" for m in ("entry", "scaled", "none")}
        for mode, rd in runs.items():
            m = pl.read_ndjson(rd / "metrics.jsonl")
            assert m["step"].to_list() == list(range(1, len(m) + 1)) and len(m) >= 2
            assert (m["clip"] == mode).all() and (m["kl/true"] >= 0).all()
            # the optimised loss is exactly what the instruments say it should be, from the same logits
            if mode == "none":
                assert (m["loss"] - m["kl/true"]).abs().max() < 1e-5 and (m["update_cos"] > 1 - 1e-6).all()
            if mode == "entry":
                assert (m["loss"] - m["entry/loss"]).abs().max() < 1e-5
                assert (m["loss"] <= m["kl/true"] + 1e-6).all()
            if mode == "scaled":
                assert (m["loss"] <= 0.05 + 1e-6).all() and (m["update_cos"] > 1 - 1e-6).all()
            ev = pl.read_ndjson(rd / "eval.jsonl")
            assert 0 in ev["step"].unique().to_list()
        # every run of a seed starts from the same base: identical step-0 evaluations
        step0 = [pl.read_ndjson(rd / "eval.jsonl").filter(pl.col("step") == 0).sort("problem_id")["correct"].to_list() for rd in runs.values()]
        assert step0[0] == step0[1] == step0[2]
    page = (out / "report-soft" / "index.html").read_text()
    import re
    assert page.count("<script") >= 1 and not re.search(r"<script[^>]+src=[\"']https?:", page)  # opens offline
    assert pl.read_csv(out / "summary.csv").height >= 3
