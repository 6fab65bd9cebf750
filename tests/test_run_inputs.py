"""Bad inputs to a training run, each a one-line error naming the field, file or folder, raised before any
long work and before anything in the run folder is written or overwritten: the table below (input -> message), then
the run-folder cases (a crafted or old-format checkpoint, another config, a file in place of the folder, prompts
longer than the model's context), and what a start records."""
import io, json
from pathlib import Path

import pytest
import torch

from opsd.repro import weights_fingerprint
from opsd.runs import RunDir, load_model, read_metrics
from opsd.train import OPSDConfig, OPSDTrainer


def tiny_cfg(ckpt, run_dir, **kw) -> OPSDConfig:
    base = dict(model=str(ckpt), run_dir=str(run_dir), steps=2, save_every=1, batch_size=4, micro_batch_size=4,
                sampling=dict(max_tokens=6), log_positions=0, padding="aligned")
    return OPSDConfig.toy(**{**base, **kw})


def trainer(cfg, problems, **kw) -> OPSDTrainer:
    return OPSDTrainer(cfg, problems, progress=False, **kw)


def snapshot(run_dir) -> dict:
    "Every file of a run folder (but the lock) and its bytes."
    root = Path(run_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".opsd.lock"}


def yaml_file(tmp_path, text):
    p = tmp_path / "c.yaml"; p.write_text(text); return p


# ---------------------------------------------------------------- config inputs: input -> message
CONFIG_TABLE = [
    ("seed -1", lambda tmp: OPSDConfig(seed=-1), ValueError, "config field seed=-1: must be in [0, 4294967295]"),
    ("seed 2**32", lambda tmp: OPSDConfig(seed=2**32), ValueError, "config field seed=4294967296: must be in"),
    ("seed 1.5", lambda tmp: OPSDConfig(seed=1.5), ValueError, "config field seed=1.5: expected an integer"),
    ("seed text", lambda tmp: OPSDConfig(seed="abc"), ValueError, "config field seed='abc': expected a number"),
    ("unknown prompt key", lambda tmp: OPSDConfig(prompt={"instrucion": "Answer."}), ValueError,
     "config field prompt: unknown key(s) ['instrucion']; valid keys: ['student_template'"),
    ("cpu_threads -1", lambda tmp: OPSDConfig(cpu_threads=-1), ValueError, "config field cpu_threads=-1: must be in"),
    ("YAML unclosed bracket", lambda tmp: OPSDConfig.from_yaml(yaml_file(tmp, "lr: 1e-4\nclip: [entry\nsteps: 3\n")),
     ValueError, "c.yaml: line 3, column 6: not valid YAML"),
    ("YAML bad indentation", lambda tmp: OPSDConfig.from_yaml(yaml_file(tmp, "lr: 1e-4\n  steps: 3\n")),
     ValueError, "c.yaml: line 2, column 8: not valid YAML"),
    ("YAML not a mapping", lambda tmp: OPSDConfig.from_yaml(yaml_file(tmp, "- lr\n- steps\n")),
     ValueError, "c.yaml: expected a mapping of config fields, got list"),
    ("YAML prompt key", lambda tmp: OPSDConfig.from_yaml(yaml_file(tmp, "prompt:\n  guard2: x\n")),
     ValueError, "c.yaml: config field prompt: unknown key(s) ['guard2']"),
    ("YAML missing", lambda tmp: OPSDConfig.from_yaml(tmp / "none.yaml"), FileNotFoundError,
     "config file {tmp}/none.yaml does not exist"),
    ("model folder missing", lambda tmp: load_model(tmp / "no-model"), FileNotFoundError,
     "model folder {tmp}/no-model does not exist$"),
    ("model folder ./m", lambda tmp: load_model("./no-such-model-here"), FileNotFoundError,
     "model folder ./no-such-model-here does not exist$"),
    ("model folder a/b/c", lambda tmp: load_model("runs/x/final"), FileNotFoundError,
     "model folder runs/x/final does not exist$"),
    ("model path a file", lambda tmp: load_model(yaml_file(tmp, "x: 1\n")), NotADirectoryError,
     "model folder {tmp}/c.yaml is a file"),
]


@pytest.mark.parametrize("name, make, exc, message", CONFIG_TABLE, ids=[r[0] for r in CONFIG_TABLE])
def test_config_input_errors(tmp_path, name, make, exc, message):
    """Each bad config input raises its type with a one-line message naming the field or file (and the line of bad
    YAML). Breaks that made it fail: `seed` left out of the range checks (the seed rows); the prompt-key check
    removed from __post_init__ (unknown prompt key); `from_yaml` without its YAMLError handler (a yaml ScannerError
    with no file name); `load_model` passing a missing local path on to transformers (a hub lookup, then
    "... and no hub model could be loaded either")."""
    with pytest.raises(exc) as e:
        make(tmp_path)
    text, want = str(e.value), message.format(tmp=tmp_path)
    if want.endswith("$"): assert text == want[:-1], text      # the whole message
    else: assert want in text, text
    assert "\n" not in text


def test_model_folder_x_slash_y_with_a_local_x(tmp_path, monkeypatch):
    "'runs/x' where ./runs is a folder is a local path: refused as a missing folder, not tried on the hub."
    (tmp_path / "runs").mkdir(); monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="^model folder runs/x does not exist$"):
        load_model("runs/x")


# ---------------------------------------------------------------- run folder inputs
def test_crafted_checkpoint_is_refused(tiny_ckpt, toy_problems, tmp_path):
    """A trainer_state.pt whose unpickling would create a file: resuming raises a ValueError naming the file, the file
    is not created, and nothing in the run folder changes. The same for the old pickled format (numpy's RNG state
    as an ndarray). Break that made it fail: `torch.load(..., weights_only=False)` in read_trainer_state (the marker
    file is created, then a KeyError instead of the refusal)."""
    import numpy as np
    cfg = tiny_cfg(tiny_ckpt, tmp_path / "run", steps=3)
    trainer(cfg, toy_problems).fit(stop_after=1)
    state = tmp_path / "run" / "checkpoints" / "step-1" / "trainer_state.pt"
    marker = tmp_path / "marker"

    class Crafted:
        def __reduce__(self): return (io.open, (str(marker), "w"))
    for name, payload in [("crafted", dict(format=2, step=1, rng=Crafted())),
                          ("old format", dict(step=1, rng=dict(numpy=np.random.get_state())))]:
        torch.save(payload, state)
        before = snapshot(tmp_path / "run")
        with pytest.raises(ValueError) as e:
            trainer(cfg, toy_problems).fit()
        assert str(e.value).startswith(f"{state}: refused: loading it would run pickled Python code"), (name, e.value)
        assert not marker.exists(), name
        assert snapshot(tmp_path / "run") == before, name
    torch.save(dict(format=2, step=1, rng=Crafted()), state)
    torch.load(state, weights_only=False)                  # an unsafe load would have run it
    assert marker.exists()


def test_another_config_is_refused_and_fresh_clears_everything(tiny_ckpt, toy_problems, tmp_path):
    """Resuming with fields that change results is refused, listing each old -> new, with config.json and every row
    untouched (a different lora_r used to fail inside load_state_dict after config.json was overwritten); --fresh
    (resume=False) removes metrics, positions, eval rows, starts and checkpoints first. Breaks that made it fail:
    `check_run_config` not called (the lora_r row: a RuntimeError from load_state_dict's size mismatches);
    `RunDir.clear` keeping eval.jsonl (an old evaluation row survives the fresh run)."""
    cfg = tiny_cfg(tiny_ckpt, tmp_path / "run", log_positions=2)
    trainer(cfg, toy_problems).fit()
    rd = RunDir(cfg.run_dir)
    rd.append_eval([dict(step=2, seed=0, split="test", correct=1.0)])
    before = snapshot(rd.path)
    for change, listed in [(dict(lora=dict(r=4)), "lora.r: 8 -> 4"),
                           (dict(clip="scaled", lr=3e-3), "clip: 'entry' -> 'scaled'; lr: 0.001 -> 0.003"),
                           (dict(steps=3), "steps: 2 -> 3"),                   # the linear schedule depends on it
                           (dict(name="other"), "name: None -> 'other'")]:
        with pytest.raises(ValueError) as e:
            trainer(cfg.replace(**change), toy_problems).fit()
        assert str(e.value) == (f"run folder {rd.path} holds a run with another config ({listed}); start over "
                                "with --fresh (opsd train; fit(resume=False)), or use another run folder")
        assert snapshot(rd.path) == before, change
    trainer(cfg.replace(save_every=2), toy_problems).fit()          # where checkpoints fall may differ
    trainer(cfg.replace(clip="scaled"), toy_problems).fit(resume=False)
    assert read_metrics(rd.path)["clip"].to_list() == ["scaled", "scaled"] and rd.eval().height == 0
    assert [(s["fresh"], s["start_step"]) for s in rd.starts()] == [(True, 0)]
    assert json.loads(rd.config_path.read_text())["clip"] == "scaled"
    assert [p.name for p in rd.checkpoints()] == ["step-1", "step-2"]


def test_run_folder_that_is_a_file_or_has_no_config(tiny_ckpt, toy_problems, tmp_path):
    """A run folder path that is a file, or is under one, is a NotADirectoryError naming it; a folder with metrics
    but no config.json is refused (which config wrote them is unknown). Nothing is written in either case."""
    (tmp_path / "f").write_text("x")
    for rd, msg in [(tmp_path / "f", f"run folder {tmp_path}/f is a file"),
                    (tmp_path / "f" / "run", f"run folder {tmp_path}/f/run is under {tmp_path}/f, which is a file")]:
        with pytest.raises(NotADirectoryError, match="^" + msg):
            trainer(tiny_cfg(tiny_ckpt, rd), toy_problems).fit()
    assert (tmp_path / "f").read_text() == "x"
    rd = RunDir(tmp_path / "noconf"); rd.append_metrics(dict(step=1, loss=0.5))
    with pytest.raises(ValueError, match="holds metrics or checkpoints but no config.json"):
        trainer(tiny_cfg(tiny_ckpt, rd.path), toy_problems).fit()
    assert read_metrics(rd.path)["step"].to_list() == [1]


def test_prompts_longer_than_the_context_are_refused_before_the_model_loads(tiny_ckpt, toy_problems, tmp_path,
                                                                            monkeypatch):
    """A problem whose prompt plus sampling.max_tokens exceeds the model's context (1024 here) is refused at
    OPSDTrainer(), naming the data, the row id and the counts, before the model is loaded. Break that made it fail:
    the check called after load_model (the stubbed loader below raises first)."""
    import opsd.train
    long = dict(problem="12+34=" * 200, solution="46", answer="46", id="long-row")
    probs = [*toy_problems[:5], long]
    cfg = tiny_cfg(tiny_ckpt, tmp_path / "run", data="problems.jsonl")

    def no_load(*a, **k): raise AssertionError("the model was loaded before the context check")
    monkeypatch.setattr(opsd.train, "load_model", no_load)
    with pytest.raises(ValueError) as e:
        trainer(cfg, probs)
    assert str(e.value).startswith("problems.jsonl: 1 of 6 student prompts do not fit the model's context of 1024 "
                                   "tokens with 6 completion tokens (longest: row 'long-row'"), e.value
    assert not (tmp_path / "run").exists()
    short_solution_long_teacher = dict(problem="1+1=", solution="2 " * 1100, answer="2", id="t")
    with pytest.raises(ValueError, match="1 of 6 teacher prompts do not fit"):
        trainer(cfg, [*toy_problems[:5], short_solution_long_teacher])


def test_start_record_and_threads(tiny_ckpt, toy_problems, tmp_path):
    """Each start appends to starts.jsonl: time, start step, the checkpoint resumed (or null), fresh, the environment
    and the base's weight fingerprint; cpu_threads sets torch's threads on CPU. Break that made it fail: the
    fingerprint taken of cfg.model instead of the resolved model path (null here, where model_path is given)."""
    old = torch.get_num_threads()
    try:
        cfg = tiny_cfg(tiny_ckpt, tmp_path / "run", steps=3, model="toy", cpu_threads=2)
        trainer(cfg, toy_problems, model_path=str(tiny_ckpt)).fit(stop_after=2)
        assert torch.get_num_threads() == 2
        trainer(cfg.replace(cpu_threads=2), toy_problems, model_path=str(tiny_ckpt)).fit()
    finally:
        torch.set_num_threads(old)
    s = RunDir(tmp_path / "run").starts()
    assert [(r["start_step"], r["resumed_from"], r["fresh"]) for r in s] == [(0, None, False),
                                                                            (2, "checkpoints/step-2", False)]
    assert s[0]["base_fingerprint"] == weights_fingerprint(tiny_ckpt) and s[0]["model"] == str(tiny_ckpt)
    env = s[1]["environment"]
    assert env["numerics"]["torch_threads"] == 2
    assert env["packages"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    assert {"python", "cpu", "numerics", "packages"} <= set(env)


def test_checkpoint_holds_every_rng_as_plain_values(tiny_ckpt, toy_problems, tmp_path):
    """trainer_state.pt loads with weights_only=True and restores python's, numpy's (with a cached gaussian) and torch's
    generators exactly: the draws after load_checkpoint equal the draws after save_checkpoint. Breaks that made it
    fail: numpy's state not restored in `_set_rng_state`; the gauss value of python's state dropped (saved as None)."""
    import random
    import numpy as np
    from opsd.train import save_checkpoint, load_checkpoint
    tr = trainer(tiny_cfg(tiny_ckpt, tmp_path / "run"), toy_problems)
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    random.gauss(0, 1); np.random.standard_normal()        # both now hold a cached second gaussian
    ck = save_checkpoint(tmp_path / "run", 1, tr.unwrapped, tr.optimizer, tr.scheduler, tr.teacher)

    def draws():
        return (random.gauss(0, 1), random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(3).tolist())
    want = draws()
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    assert state["rng"]["python"]["gauss"] is not None and state["rng"]["numpy"]["has_gauss"] == 1
    random.seed(9); np.random.seed(9); torch.manual_seed(9); draws()
    assert load_checkpoint(ck, tr.unwrapped, tr.optimizer, tr.scheduler, tr.teacher) == 1
    assert draws() == want


def test_resume_on_other_base_weights_is_refused(tiny_ckpt, toy_problems, tmp_path):
    """The same config, but the model folder's weights changed since the checkpoint (a rebuilt toy base): resuming is
    refused, naming both fingerprints, with nothing written; --fresh trains on the new base. Break that made it fail:
    `check_same_base` not called in `fit` (the run resumes and mixes two bases)."""
    import shutil
    from safetensors.torch import load_file, save_file
    base = tmp_path / "base"; shutil.copytree(tiny_ckpt, base)
    cfg = tiny_cfg(base, tmp_path / "run", steps=3)
    trainer(cfg, toy_problems).fit(stop_after=1)
    old = weights_fingerprint(base)
    w = load_file(str(base / "model.safetensors"))
    k = sorted(w)[0]; w[k] = w[k].clone(); w[k].view(-1)[0] += 1e-3   # one number of the base moves
    save_file(w, str(base / "model.safetensors"), metadata={"format": "pt"})
    new = weights_fingerprint(base)
    before = snapshot(tmp_path / "run")
    with pytest.raises(ValueError) as e:
        trainer(cfg, toy_problems).fit()
    assert str(e.value) == (f"run folder {tmp_path / 'run'} was trained on base weights {old}, but the model folder now "
                            f"holds {new} (rebuilt or replaced); start over with --fresh (opsd train; "
                            "fit(resume=False)), or use another run folder")
    assert snapshot(tmp_path / "run") == before
    trainer(cfg, toy_problems).fit(resume=False)
    assert [s["base_fingerprint"] for s in RunDir(tmp_path / "run").starts()] == [new]
