"""What a user has is not lost or silently wrong: `--fresh` removes only what opsd wrote, a diverging run stops with
one line before saving, a data file's answers get the math grader, and SIGTERM saves like SIGINT (tests/test_crash.py).
The table of bad inputs is tests/test_inputs.py; the held-out split and the eval setting are shown there (toy data) and
below (SmolLM2)."""
import json

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
                         micro_batch_size=2, max_completion_length=4, log_positions=0, padding="aligned", lr=1e30,
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
