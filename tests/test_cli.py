"""The command line: help, errors, `opsd padding`, and a reduced `opsd demo` whose saved numbers must be consistent.

Every command runs in this process through `opsd.cli.main` (conftest.opsd_main: the real parser, checks and commands,
without a fresh interpreter's seconds of importing torch); `test_console_script_exit_code` runs the installed `opsd`
entry point once, where the process boundary (its exit code and stderr) is what is checked."""
import json, subprocess

import polars as pl
import pytest

from conftest import opsd_main, venv_bin
from opsd.config import upgrade_config


def run(*args, check=True):
    "`opsd ARGS` in this process: (exit code, stdout, stderr); with check, a non-zero code fails the test."
    code, out, err = opsd_main(*args)
    if check: assert code == 0, err[-3000:]
    return code, out, err


@pytest.mark.parametrize("cmd", ["demo", "train", "eval", "report", "padding", "analyze", "export"])
def test_help(cmd):
    code, out, _ = run(cmd, "--help", check=False)
    assert code == 0 and "usage: opsd " + cmd in out


def test_console_script_exit_code(tiny_ckpt, tmp_path):
    """The installed `opsd` script (a fresh process): bad input is exit code 2 and one line `opsd: error: ...` on
    stderr; other bad inputs, in this process, are the rows of tests/test_inputs.py."""
    r = subprocess.run([venv_bin("opsd"), "train", "--model", str(tiny_ckpt), "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("opsd: error:")]
    assert r.returncode == 2 and len(lines) == 1 and "--data is required" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


def test_padding_json(tiny_ckpt, toy_data_file):
    _, out, _ = run("padding", "--model", tiny_ckpt, "--data", toy_data_file, "--n", 8, "--max-new-tokens", 16, "--json")
    rep = json.loads(out)
    assert rep["n"] == 8 and rep["sampling"]["max_new_tokens"] == 16
    sdpa = rep["perturbation"]["sdpa"]
    # aligned: every row equals itself scored alone (float rounding only); released: the pad gap moves the teacher
    assert sdpa["aligned"]["kl_max"] < 1e-9 < sdpa["released"]["kl_mean"]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    _, stdout, _ = run("demo", "--quick", "--seeds", "2", "--teachers", "soft", "--clips", "entry", "scaled", "none",
                       "--out", out, "--no-png")
    return out, stdout


def test_quick_demo_outputs_are_consistent(quick_demo):
    out, stdout = quick_demo
    # progress while the runs train: steps done of the total over all runs (6 runs of the quick recipe)
    import re
    prog = re.findall(r"training (\d+)/(\d+) steps \(\d+%\), (\d)/6 runs trained", stdout)
    assert prog and all(int(a) <= int(b) for a, b, _ in prog), stdout[-2000:]
    # the report opens with what the numbers mean, shows the effects as a table, a caption under each figure, and one
    # completion per clip mode token by token
    page = (out / "report-soft" / "index.html").read_text()
    assert page.count('<p class="lead">') == 2 and "<b>How to read it.</b>" in page
    assert "<th>effect</th>" in page and "held-out acc change" not in page.split("<pre>")[0].split("<table>")[0]
    assert page.count('<p class="cap">') >= page.count('<section class="fig" id="') - page.count('id="token-view-')
    views = re.findall(r"<h3>(soft-\w+-s0)</h3>", page)
    assert sorted(views) == ["soft-entry-s0", "soft-none-s0", "soft-scaled-s0"], views
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
        step0 = [pl.read_ndjson(rd / "eval.jsonl")
                 .filter(pl.col("step") == 0).sort("problem_id")["correct"].to_list() for rd in runs.values()]
        assert step0[0] == step0[1] == step0[2]
    page = (out / "report-soft" / "index.html").read_text()
    import re
    assert page.count("<script") >= 1 and not re.search(r"<script[^>]+src=[\"']https?:", page)  # opens offline
    assert pl.read_csv(out / "summary.csv").height >= 3


def test_choices_are_the_config_constants():
    """The flags' allowed values are the config's own constant objects, not re-typed lists.
    Break: `--clip` given choices=["entry", "token", "scaled", "none"] (a copy) -> the identity check fails."""
    from opsd.cli import parser, TRAIN_FLAGS
    from opsd.loss import CLIP_MODES
    from opsd.train import LAYOUTS, OPSDConfig, ROLLOUTS, SCHEDULERS, TEACHER_MODES
    from opsd.toy import TOY_PRESETS
    import dataclasses
    sub = parser()._subparsers._group_actions[0].choices
    acts = lambda cmd: {a.dest: a for a in sub[cmd]._actions}
    t, d, e = acts("train"), acts("demo"), acts("eval")
    for name, const in (("clip", CLIP_MODES), ("teacher", TEACHER_MODES), ("padding", LAYOUTS),
                        ("scheduler", SCHEDULERS), ("rollout", ROLLOUTS)):
        assert t[name].choices is const, name
    assert d["clips"].choices is CLIP_MODES and e["backend"].choices is ROLLOUTS
    assert sorted(d["teachers"].choices) == sorted(TOY_PRESETS)
    assert set(TRAIN_FLAGS) <= {f.name for f in dataclasses.fields(OPSDConfig)}
    assert {k for k in t if k in {f.name for f in dataclasses.fields(OPSDConfig)}} == set(TRAIN_FLAGS)


def test_train_preset_follows_the_world(tmp_path):
    "Break: config_from_args always starting from OPSDConfig() -> `--model toy:copy` gets lora.r 64 and bfloat16."
    from opsd.cli import parser, config_from_args
    from opsd.train import OPSDConfig
    cfg = config_from_args(parser().parse_args(["train", "--model", "toy:copy", "--clip", "none", "--set", "tau=0.2"]))
    assert cfg.to_dict() == OPSDConfig.toy(model="toy:copy", clip="none", tau=0.2).to_dict()
    y = tmp_path / "c.yaml"
    y.write_text("model: toy\nsteps: 7\nlr: 0.5\n")
    cfg = config_from_args(parser().parse_args(["train", "--config", str(y), "--lr", "0.25"]))
    assert (cfg.model, cfg.steps, cfg.lr, cfg.lora.r) == ("toy", 7, 0.25, 8)  # world preset < file < flags
    cfg = config_from_args(parser().parse_args(["train", "--model", "toy", "--preset", "released"]))
    assert cfg.to_dict() == OPSDConfig(model="toy").to_dict()


# -- SmolLM2 on this CPU, through the user's commands (the conversion is cached once per machine) --

@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
    rd = tmp_path_factory.mktemp("smol") / "run"
    run("train", "--model", "smollm2", "--steps", "1", "--batch-size", "2", "--micro-batch-size", "2",
        "--set", "sampling.max_tokens=16", "log_positions=4", "teacher_context=none", "--run-dir", rd, "--quiet")
    return rd


def test_train_smollm2_on_cpu(smollm2_run):
    """`opsd train --model smollm2 --steps 1` with a small batch runs on CPU with the world's preset, here with the
    teacher that reads no reference (`teacher_context=none`: the KL is the prompt change alone, still above 0)."""
    from opsd.smollm2 import SMOLLM2_RECIPE
    rd = smollm2_run
    cfg = json.loads((rd / "config.json").read_text())
    assert (cfg["model"], cfg["dtype"], cfg["rollout"], cfg["batch_size"], cfg["sampling"]["max_tokens"],
            cfg["teacher_context"]) == ("smollm2", "float32", "hf", 2, 16, "none")
    mine = ("dtype", "rollout", "batch_size", "micro_batch_size", "steps", "sampling.max_tokens", "run_dir",
            "log_positions", "teacher_context")  # set on the command line, or the CPU's choices
    flat = upgrade_config(cfg, flat=True)   # nested fields by their dotted names
    recipe = {k: v for k, v in upgrade_config(SMOLLM2_RECIPE, flat=True).items() if k not in mine}
    assert {k: flat[k] for k in recipe} == recipe
    m = pl.read_ndjson(rd / "metrics.jsonl")
    assert m["step"].to_list() == [1] and m["kl/true"][0] > 0
    assert (rd / "checkpoints" / "step-1").exists()


def test_eval_smollm2_run(smollm2_run):
    """`opsd eval` of a smollm2 run: the base and step 1 on the world's held-out problems, graded in math mode, greedy
    (the world's evaluation); `--temperature 1.0` evaluates again at the released sampling, as rows of their own, and
    the first command again prints the first setting's numbers, named by its setting (nothing is sampled again).
    Breaks that made it fail: `cmd_eval` not passing the world's sampling (rows at temperature 1.0 the first time);
    eval_runs summarising the latest-written setting (the third table printed the temperature-1.0 numbers)."""
    rd = smollm2_run
    _, first, _ = run("eval", rd, "--n", "2", "--max-new-tokens", "16", "--quiet")
    ev = pl.read_ndjson(rd / "eval.jsonl")
    assert sorted(ev["step"].unique().to_list()) == [0, 1] and ev.height == 4   # k = 1: the world's default
    assert (ev["key_temperature"].unique().to_list(), ev["key_k"].unique().to_list()) == ([0.0], [1])
    from opsd.smollm2 import word_problems
    want = sorted(str(p["answer"]) for p in word_problems(2, seed=10_000, split="test"))
    assert sorted(ev.filter(pl.col("step") == 0)["answer"].cast(pl.Utf8).to_list()) == want
    _, second, _ = run("eval", rd, "--n", "2", "--max-new-tokens", "16", "--temperature", "1.0", "--quiet")
    ev = pl.read_ndjson(rd / "eval.jsonl")
    assert ev.group_by("key_temperature").len().sort("key_temperature").rows() == [(0.0, 4), (1.0, 4)]
    _, third, _ = run("eval", rd, "--n", "2", "--max-new-tokens", "16", "--quiet")
    setting = dict(ev.select("key_temperature", "setting").unique().rows())
    assert setting[0.0] in first and setting[1.0] in second and third == first and setting[1.0] not in third


def test_export_smollm2_run(smollm2_run, tmp_path):
    "`opsd export` of the SmolLM2 run: plain from_pretrained loads the merged bf16 folder and generates (greedy)."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "smol-merged"
    run("export", smollm2_run, "--out", out, "--dtype", "bfloat16")
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and str(model.dtype) == "torch.bfloat16"
    ids = tok.apply_chat_template([dict(role="user", content="What is 2 + 3?")], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert len(gen) >= 1 and tok.decode(gen).strip()
    card = (out / "README.md").read_text()
    assert "`smollm2`" in card and "smollm2 world" in card and "Clip mode" in card


def test_quick_is_for_the_toy_only():
    "`opsd demo --quick` of another world is refused before any work (the path world's demo: tests/test_demo.py)."
    code, _, err = run("demo", "--model", "smollm2", "--quick", check=False)
    assert code == 2 and "--quick" in err
