"""Crash safety, tested by killing real processes: `kill -9` between checkpoints, during a checkpoint write
and before the first checkpoint, a real full disk (a file size limit) while writing a checkpoint or a metrics row, and
two processes on one run folder. After each, the same command again must give what an uninterrupted run of the same
seed gives: the same metrics and position rows (no row twice, none torn) and the same final adapter, bit for bit.

Each run is a fresh `python -c RUNNER` process on the tiny Qwen3 checkpoint (conftest `tiny_ckpt`), 6 steps with a
checkpoint every 2, LoRA dropout and an EMA teacher, so that RNG and teacher state must survive the restart. A kill
lands where it is meant to through the test hook `OPSD_TEST_PAUSE=where:step` (opsd.train `_test_pause`): the trainer
creates the marker file `OPSD_TEST_PAUSE_MARK` there and waits while it exists."""
import json, os, resource, signal, subprocess, sys, time, warnings
from pathlib import Path

import pytest
from safetensors.torch import load_file

from opsd.runs import RunDir, jsonl_rows

RUNNER = """
import json, sys
from opsd.data import load_problems
from opsd.train import OPSDConfig, OPSDTrainer
a = json.loads(sys.argv[1])
cfg = OPSDConfig.toy(**a["cfg"])
OPSDTrainer(cfg, load_problems(cfg.data), progress=False).fit(resume=not a.get("fresh"), stop_after=a.get("stop_after"))
"""
STEPS, EVERY = 6, 2


def config(ckpt, data, run) -> dict:
    return dict(model=str(ckpt), data=str(data), run_dir=str(run), steps=STEPS, save_every=EVERY, batch_size=8,
                micro_batch_size=4, lora=dict(dropout=0.1), sampling=dict(max_tokens=12), ema=dict(decay=0.5),
                log_positions=1, padding="aligned", teacher="ema",
                lr=1e-2)


def start(cfg: dict, pause: str | None = None, mark: Path | None = None, stop_after=None, fsize: int | None = None):
    "The runner as a real process; `pause`: where it waits for a kill; `fsize`: a file size limit in bytes."
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_TEST_PAUSE")}
    if pause: env.update(OPSD_TEST_PAUSE=pause, OPSD_TEST_PAUSE_MARK=str(mark))

    def limit():   # in the child: writes past `fsize` bytes then fail with EFBIG (SIGXFSZ ignored), as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(dict(cfg=cfg, stop_after=stop_after))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit if fsize else None)


def run(cfg: dict, **kw) -> subprocess.CompletedProcess:
    p = start(cfg, **kw)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def ok(cfg: dict, **kw):
    r = run(cfg, **kw)
    assert r.returncode == 0, r.stderr[-3000:]


def wait_for(p: subprocess.Popen, mark: Path, timeout=180):
    t0 = time.time()
    while not mark.exists():
        if p.poll() is not None: pytest.fail(f"the run ended (rc {p.returncode}) before the pause: {p.stderr.read()}")
        if time.time() - t0 > timeout: p.kill(); pytest.fail("no pause within the timeout")
        time.sleep(0.02)


def strict_rows(path: Path) -> list[dict]:
    "Every line a whole JSON object (a torn line is an error here, not a warning)."
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return jsonl_rows(path)


def state(run_dir: Path) -> dict:
    "What a finished run left: metric rows without timings, position rows, the final adapter's tensors."
    rd = RunDir(run_dir)
    metrics = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "seconds"}
               for r in strict_rows(rd.metrics_path)]
    adapter = load_file(str(rd.checkpoints_dir / f"step-{STEPS}" / "adapter_model.safetensors"))
    return dict(metrics=metrics, positions=strict_rows(rd.positions_path), adapter=adapter,
                checkpoints=[p.name for p in rd.checkpoints()])


def assert_same_run(got: dict, want: dict):
    assert [r["step"] for r in got["metrics"]] == list(range(1, STEPS + 1))          # each step once
    assert got["metrics"] == want["metrics"]                                          # bit for bit
    assert got["positions"] == want["positions"]
    assert got["adapter"].keys() == want["adapter"].keys()
    for k in want["adapter"]: assert got["adapter"][k].equal(want["adapter"][k]), k
    assert got["checkpoints"] == want["checkpoints"]


@pytest.fixture(scope="module")
def reference(tiny_ckpt, toy_data_file, tmp_path_factory) -> dict:
    """An uninterrupted run of the config; while it is paused after step 1 (which changes no number), a second process
    on the same folder tries to start (checked in `test_second_writer_is_refused`)."""
    tmp = tmp_path_factory.mktemp("ref")
    cfg, mark = config(tiny_ckpt, toy_data_file, tmp / "run"), tmp / "paused"
    first = start(cfg, pause="step:1", mark=mark)
    wait_for(first, mark)                                    # the first holds the folder, paused after step 1
    second = run(cfg)
    mark.unlink()                                            # let the first go on
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    st = state(tmp / "run")
    assert len(st["positions"]) == STEPS and st["checkpoints"] == ["step-2", "step-4", "step-6"]
    return dict(st, second=second, first_pid=first.pid, run_dir=tmp / "run")


def test_second_writer_is_refused(reference):
    """Two processes on one run folder: the second is refused with a message naming the folder and the holder's pid,
    the first finishes, and every row is written once. Break that made it fail: `fit` without `folder_lock` (the
    second process trains too: the reference then holds 11 position rows instead of 6)."""
    second = reference["second"]
    assert second.returncode != 0
    assert f"{reference['run_dir']}: run folder is being written by another opsd process (pid {reference['first_pid']} " \
        "since" in second.stderr, second.stderr[-2000:]
    assert [r["step"] for r in reference["metrics"]] == list(range(1, STEPS + 1))
    assert len(RunDir(reference["run_dir"]).starts()) == 1       # the refused process wrote nothing


def test_kill_9_then_same_command_equals_uninterrupted(tiny_ckpt, toy_data_file, reference, tmp_path):
    """kill -9 before the first checkpoint, then between checkpoints, then during a checkpoint write, each followed by
    the same command: the end result (metrics, positions, final adapter) equals the uninterrupted run bit for bit,
    each step once. Breaks that made it fail: resume without truncation when no checkpoint exists (steps 1, 1, 2, ..
    after the first kill); `truncate_after` skipped on resume (step 3 twice); `save_checkpoint` writing straight into
    step-N instead of a temporary folder (after the third kill a step-4 holding an adapter but no trainer_state.pt is
    the latest checkpoint)."""
    cfg, mark = config(tiny_ckpt, toy_data_file, tmp_path / "run"), tmp_path / "paused"
    rd = RunDir(cfg["run_dir"])
    for pause, rows, latest in [("step:1", 1, None),            # before the first checkpoint (at step 2)
                                ("step:3", 3, "step-2"),        # between checkpoints
                                ("save:4", 4, "step-2")]:       # while step-4's checkpoint is being written
        p = start(cfg, pause=pause, mark=mark)
        wait_for(p, mark)
        p.send_signal(signal.SIGKILL); p.wait(timeout=60); p.stderr.close(); p.stdout.close(); mark.unlink()
        assert [r["step"] for r in jsonl_rows(rd.metrics_path)] == list(range(1, rows + 1)), pause
        assert (rd.latest_checkpoint().name if rd.latest_checkpoint() else None) == latest, pause
    assert (rd.checkpoints_dir / "step-4.tmp" / "adapter_model.safetensors").exists()   # the kill landed in the save
    ok(cfg)                                                                      # the same command, to the end
    got = state(rd.path)
    assert_same_run(got, reference)
    assert [(s["start_step"], s["resumed_from"]) for s in rd.starts()] == [
        (0, None), (0, None), (2, "checkpoints/step-2"), (2, "checkpoints/step-2")]
    assert not (rd.checkpoints_dir / "step-4.tmp").exists()


def test_disk_full_then_same_command_resumes(reference, tmp_path):
    """A real write failure (RLIMIT_FSIZE: EFBIG, handled as ENOSPC) while appending a metrics row, then while
    writing a checkpoint: each a one-line error naming the file or checkpoint and what is intact; nothing partial is
    left (no torn row, no step-N.tmp); the previous checkpoint loads, and the same command without the limit ends
    equal to the uninterrupted run. Breaks that made it fail: the error re-raised untranslated (`OSError: [Errno 27]
    File too large`, naming no checkpoint); trainer_state.pt written by torch.save straight to the file (`RuntimeError:
    [enforce fail at inline_container.cc:672] unexpected pos`); `append_jsonl` not cutting the file back (300 bytes
    of a partial row 5 left)."""
    import shutil
    shutil.copytree(reference["run_dir"], tmp_path / "run")      # a run folder whose latest checkpoint is step-4
    rd = RunDir(tmp_path / "run")
    shutil.rmtree(rd.checkpoints_dir / "step-6"); rd.truncate_after(4); (rd.path / ".opsd.lock").unlink()
    cfg = {**rd.read_config(), "run_dir": str(rd.path)}
    cfg = {k: v for k, v in cfg.items() if k in config("", "", "")}
    # 1. a metrics row: the file may grow by less than a row
    size = rd.metrics_path.stat().st_size
    r = run(cfg, fsize=size + 300)
    assert r.returncode != 0
    assert f"disk full while writing {rd.metrics_path} (File too large); its earlier rows are intact" in r.stderr, \
        r.stderr[-2000:]
    assert rd.metrics_path.stat().st_size == size and [x["step"] for x in strict_rows(rd.metrics_path)] == [1, 2, 3, 4]
    # 2. a checkpoint: the adapter (53 KB) fits, trainer_state.pt (195 KB) does not
    r = run(cfg, fsize=100_000)
    assert r.returncode != 0
    assert (f"disk full while writing checkpoint step-6 to {rd.checkpoints_dir} (File too large); the previous "
            "checkpoint step-4 is intact; free some space, then run the same command again") in r.stderr, r.stderr
    assert "inline_container" not in r.stderr
    assert sorted(p.name for p in rd.checkpoints_dir.iterdir()) == ["step-2", "step-4"]   # no step-6.tmp
    ok(cfg)                                                                         # space again: it resumes
    assert_same_run(state(rd.path), reference)
    assert [s["resumed_from"] for s in rd.starts()] == [None] + ["checkpoints/step-4"] * 3


def test_sigterm_saves_a_checkpoint_like_sigint(tiny_ckpt, toy_data_file, tmp_path):
    """SIGTERM (what job schedulers send before they kill) during step 1 of a run that saves every 2 steps: the step
    finishes, a checkpoint of step 1 is saved and the process exits (non-zero). Break that made it fail: the handler
    installed for SIGINT only (the process died at once: no checkpoint)."""
    cfg, mark = config(tiny_ckpt, toy_data_file, tmp_path / "run"), tmp_path / "paused"
    p = start(cfg, pause="step:1", mark=mark)
    wait_for(p, mark)
    p.send_signal(signal.SIGTERM); mark.unlink()
    out, err = p.communicate(timeout=300)
    rd = RunDir(cfg["run_dir"])
    assert p.returncode != 0 and "SIGTERM: finishing step, saving a checkpoint" in out, (out + err)[-2000:]
    assert [r["step"] for r in strict_rows(rd.metrics_path)] == [1]
    assert [c.name for c in rd.checkpoints()] == ["step-1"]
