"""Crash safety of `opsd eval`, tested by killing: a real `opsd eval` subprocess (tiny Qwen3, HF backend) is killed
with SIGKILL mid-sweep, then the same command runs again: eval.jsonl has no repeated or torn rows and equals, row for
row and value for value, the file of an uninterrupted sweep of the same command. Two at once: the second waits."""
import copy
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import venv_bin

STEPS, SEEDS, N, K = 6, (0, 1), 24, 2
BLOCK = N * K  # rows of one (step, seed) block
TOTAL = (STEPS + 1) * len(SEEDS) * BLOCK  # the base and every checkpoint, every seed
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def eval_cmd(run: Path) -> list[str]:
    data = json.loads((run / "config.json").read_text())["data"]   # no held-out split recorded: --data is required
    return [venv_bin("opsd"), "eval", str(run), "--data", data, "--backend", "hf", "--n", str(N), "--k", str(K),
            "--max-new-tokens", "40", "--seeds", *map(str, SEEDS), "--quiet"]


@pytest.fixture(scope="module")
def pristine(tiny_ckpt, toy_data_file, tmp_path_factory) -> Path:
    "A run folder (config + 6 random non-zero LoRA checkpoints of the tiny model), never evaluated."
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opsd.runs import RunDir

    rd = RunDir(tmp_path_factory.mktemp("crash") / "run")
    rd.write_config(dict(model=str(tiny_ckpt), dtype="float32", name="crash", seed=0, data=str(toy_data_file)))
    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    for s in range(1, STEPS + 1):
        torch.manual_seed(s)
        lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(copy.deepcopy(base), lora).save_pretrained(rd.checkpoints_dir / f"step-{s}")
    return rd.path


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def reference(pristine, tmp_path_factory) -> bytes:
    "eval.jsonl of the uninterrupted command."
    run = copy_run(pristine, tmp_path_factory.mktemp("ref") / "run")
    subprocess.run(eval_cmd(run), check=True, env=ENV, capture_output=True, timeout=300)
    return (run / "eval.jsonl").read_bytes()


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def kill_mid_sweep(run: Path, after_rows: int) -> int:
    "Start the command, SIGKILL it once eval.jsonl holds `after_rows` rows; the rows it left."
    p = subprocess.Popen(eval_cmd(run), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and lines(run / "eval.jsonl") < after_rows:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = lines(run / "eval.jsonl")
    assert p.returncode == -signal.SIGKILL, "the sweep finished before it could be killed: give it more work"
    assert after_rows <= left < TOTAL, left
    return left


def check_file(run: Path, reference: bytes):
    rows = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["seed"], r["problem_id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == TOTAL  # no repeated rows, nothing missing
    assert rows == [json.loads(line) for line in reference.decode().splitlines()]  # same rows, same values, same order
    assert (run / "eval.jsonl").read_bytes() == reference


def test_reference_is_complete(reference):
    "The uninterrupted sweep: every block once, one setting, one fingerprint per checkpoint."
    rows = [json.loads(line) for line in reference.decode().splitlines()]
    assert len(rows) == TOTAL
    assert {r["block_rows"] for r in rows} == {BLOCK} and len({r["setting"] for r in rows}) == 1
    assert len({r["key_weights"] for r in rows}) == STEPS + 1  # the base and six different adapters


def test_kill_mid_sweep_then_same_command(pristine, reference, tmp_path):
    """SIGKILL after 3 blocks, then the same command: the file equals the uninterrupted one.
    Break that made it fail: the done-block lookup keyed with the step as a string (a key that no longer matches
    the rows read back from JSON) -> the done blocks were evaluated and appended again: 816 rows instead of 672."""
    run = copy_run(pristine, tmp_path / "run")
    kill_mid_sweep(run, after_rows=3 * BLOCK)
    r = subprocess.run(eval_cmd(run), env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    check_file(run, reference)


def test_kill_inside_a_write_then_same_command(pristine, reference, tmp_path):
    """SIGKILL mid-sweep, then the file cut inside its last line and inside a block, as a kill during the block's
    write (or a full disk) leaves it; the same command redoes that block and the file equals the uninterrupted one.
    Break that made it fail: `scan_eval` counting any block with rows as complete -> the cut block stayed short
    (648 rows instead of 672)."""
    run = copy_run(pristine, tmp_path / "run")
    left = kill_mid_sweep(run, after_rows=2 * BLOCK)
    path = run / "eval.jsonl"
    data = path.read_bytes()
    keep = data.split(b"\n")[: (left // BLOCK) * BLOCK - BLOCK // 2]  # half of the last complete block
    path.write_bytes(b"\n".join(keep) + b"\n" + data.split(b"\n")[len(keep)][:25])  # and a torn line
    r = subprocess.run(eval_cmd(run), env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rows of incomplete blocks" in r.stderr and "torn last line" in r.stderr
    check_file(run, reference)


def test_two_evals_of_one_run_at_once(pristine, reference, tmp_path):
    """Two `opsd eval` processes of one run started together: the second waits for the evaluation log's lock, then
    finds every block done; the file equals the uninterrupted one. Break that made it fail: sweep_checkpoints without
    folder_lock -> both evaluated every block: 1344 rows instead of 672."""
    run = copy_run(pristine, tmp_path / "run")
    procs = [subprocess.Popen(eval_cmd(run), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    check_file(run, reference)
    assert sum("waiting for another process" in e for e in errs) == 1  # they did overlap: one waited
