"Training: exact resume after a kill, SIGINT checkpointing, 2 processes == 1 process, gradient accumulation."
import json, os, signal, subprocess, time
from pathlib import Path

import pytest
import torch

from opsd.train import OPSDConfig, OPSDTrainer
from opsd.runs import read_metrics, latest_checkpoint
from opsd.bench import cut_completions

from conftest import venv_bin

COLS = ["step", "loss", "kl/true", "entry/loss", "entry/argmax_clipped_frac", "entry/clipped_teacher_mass",
        "entry/grad_cos", "update_cos", "grad_norm", "lr", "completion_len", "tokens"]


DATA = {}


@pytest.fixture(autouse=True, scope="module")
def _data(toy_data_file):
    DATA["path"] = str(toy_data_file)


def train_cmd(ckpt, run_dir, steps=6, extra=()):
    return [venv_bin("opsd"), "train", "--preset", "toy", "--model", str(ckpt), "--data", DATA["path"],
            "--run-dir", str(run_dir), "--steps", str(steps), "--save-every", "2", "--batch-size", "8",
            "--micro-batch-size", "4", "--quiet", "--padding", "aligned",
            "--set", "sampling.max_tokens=12", "log_positions=0", "dtype=float64", *extra]


def rows(run_dir):
    return read_metrics(run_dir).select(COLS).to_dicts()


def assert_rows_close(a, b, rtol=1e-5, atol=1e-7):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rtol, abs=atol), (k, ra, rb)


@pytest.fixture(scope="module")
def reference_run(tiny_ckpt, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    subprocess.run(train_cmd(tiny_ckpt, run), check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run


def test_kill_and_resume_is_exact(tiny_ckpt, reference_run, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen(train_cmd(tiny_ckpt, run), env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and len(read_metrics(run)) < 3:
        time.sleep(0.1)
    p.kill(); p.wait()
    killed_at = len(read_metrics(run))
    assert 3 <= killed_at < 6, killed_at
    assert latest_checkpoint(run) is not None and latest_checkpoint(run).name in ("step-2", "step-4")
    subprocess.run(train_cmd(tiny_ckpt, run), check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert rows(run) == rows(reference_run)     # bit for bit


def test_sigint_saves_a_checkpoint(tiny_ckpt, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen(train_cmd(tiny_ckpt, run, steps=50), env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and len(read_metrics(run)) < 1:
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130
    done = read_metrics(run)["step"].max()
    ck = latest_checkpoint(run)
    assert ck is not None and int(ck.name.split("-")[1]) == done and 1 <= done < 50
    st = json.loads((ck / "state.json").read_text())
    assert st["step"] == done and (ck / "adapter_model.safetensors").exists()


def test_two_processes_equal_one(tiny_ckpt, reference_run, tmp_path):
    run = tmp_path / "run2p"
    cmd = [venv_bin("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "opsd.cli"]
    cmd += train_cmd(tiny_ckpt, run)[1:] + ["replicate_rollout=true"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    # the same problems and completions, split over two ranks: equal within float tolerance (with aligned padding;
    # under the released layout the pad gap, and so the teacher, depends on which rows share a micro-batch)
    assert_rows_close(rows(run), rows(reference_run), rtol=1e-4, atol=1e-6)


def test_two_processes_packed_equal_one_padded(tiny_ckpt, reference_run, tmp_path):
    "Packed micro-batches (opsd.packing) under DDP with two processes: the one-process padded run's rows."
    run = tmp_path / "run2p-packed"
    cmd = [venv_bin("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "opsd.cli"]
    cmd += train_cmd(tiny_ckpt, run)[1:] + ["replicate_rollout=true", "padding=packed"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert json.loads((run / "config.json").read_text())["padding"] == "packed"
    assert_rows_close(rows(run), rows(reference_run), rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_is_exact(tiny_ckpt, toy_problems, tmp_path):
    "micro-batches of 2 vs one micro-batch of 8: the same gradient (global token normalisation)."
    grads = {}
    for mb in (8, 2):
        # float64 weights and loss: the two accumulation orders then agree to ~1e-15, so a tight tolerance only fails
        # when the normalisation is wrong (in float32 the summation order alone moved the loss by ~1e-7 relative)
        cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / f"mb{mb}"), steps=1, batch_size=8,
                             micro_batch_size=mb, sampling=dict(max_tokens=12), padding="aligned", log_positions=0,
                             dtype="float64")
        tr = OPSDTrainer(cfg, toy_problems, progress=False)
        tr.optimizer.step = lambda *a, **k: None  # keep the weights; read the gradient
        zg = tr.optimizer.zero_grad; tr.optimizer.zero_grad = lambda *a, **k: None
        row = tr.step(1)
        grads[mb] = (row, torch.cat([p.grad.flatten() for p in tr.params]).clone())
        zg()
    assert grads[8][1].dtype == torch.float64 and grads[8][1].abs().max() > 0
    torch.testing.assert_close(grads[2][1], grads[8][1], rtol=1e-9, atol=1e-12)
    assert grads[2][0]["loss"] == pytest.approx(grads[8][0]["loss"], rel=1e-10)
    assert grads[2][0]["kl/true"] == pytest.approx(grads[8][0]["kl/true"], rel=1e-10)


def test_length_grouping_same_step(sharp_ckpt, toy_problems, tmp_path):
    """`length_grouping=True` (micro-batches of similar completion lengths) gives the step of plan order: the same
    loss, instruments and updated adapter to float64 rounding, over completions of varied lengths (the engine's are cut
    to a fixed pattern of lengths, as a real model's would stop at EOS). Break that made it fail: `batches` reordering
    the prompts but not the completions (each prompt then scored with another row's completion)."""
    from peft.utils import get_peft_model_state_dict
    cut = [12, 2, 9, 1, 11, 3, 2, 10]
    out = {}
    for grouping in (False, True):
        cfg = OPSDConfig.toy(model=str(sharp_ckpt), run_dir=str(tmp_path / f"g{grouping}"), steps=1, batch_size=8,
                             micro_batch_size=4, sampling=dict(max_tokens=12), padding="aligned", log_positions=0,
                             dtype="float64", length_grouping=grouping)
        tr = OPSDTrainer(cfg, toy_problems, progress=False)
        seen, bat = [], tr.batches
        tr.batches = lambda mine, comps: seen.append(bat(mine, comps)) or seen[-1]
        with cut_completions(tr.rollout, lambda call, lens: cut):   # as a real model's stop at EOS anywhere
            row = tr.step(1)
        out[grouping] = (row, get_peft_model_state_dict(tr.unwrapped),
                         [b.completion_mask.sum(1).tolist() for b in seen[0]])
    assert out[False][2] == [[12, 2, 9, 1], [11, 3, 2, 10]] and out[True][2] == [[12, 11, 10, 9], [3, 2, 2, 1]]
    for k in ("loss", "kl/true", "entry/argmax_clipped_frac", "entry/grad_cos", "grad_norm", "tokens"):
        assert out[True][0][k] == pytest.approx(out[False][0][k], rel=1e-10), k
    for k, v in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], v, rtol=1e-9, atol=1e-12)
    assert out[False][0]["grad_norm"] > 0   # the adapter moved: not a comparison of two untouched states


@pytest.mark.parametrize("teacher", ["fixed", "ema", "live"])
@pytest.mark.parametrize("clip", ["entry", "scaled"])
def test_teacher_modes_and_clips_run(tiny_ckpt, toy_problems, tmp_path, teacher, clip):
    cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "r"), steps=2, batch_size=4, micro_batch_size=2,
                         save_every=1, sampling=dict(max_tokens=8), teacher=teacher, clip=clip, log_positions=8)
    OPSDTrainer(cfg, toy_problems, progress=False).fit()
    m = read_metrics(cfg.run_dir)
    assert m["step"].to_list() == [1, 2] and m["kl/true"].is_finite().all()
    assert (m["kl/true"] > 0).all()  # every teacher sees the reference solution, so it differs from the student
    assert (Path(cfg.run_dir) / "positions.jsonl").exists()


def test_bad_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="clip"):
        OPSDConfig(clip="per-entry")
    y = tmp_path / "c.yaml"; y.write_text("lr: 1e-4\nlearning_rate: 3\n")
    with pytest.raises(ValueError, match="learning_rate"):
        OPSDConfig.from_yaml(y)


def test_set_bad_value_is_a_clear_error(tiny_ckpt):
    "`opsd train --set lr=abc` names the field instead of failing in the optimizer."
    cmd = [venv_bin("opsd"), "train", "--model", str(tiny_ckpt), "--data", DATA["path"], "--set", "lr=abc"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "lr='abc'" in (r.stderr + r.stdout) and "Traceback" not in r.stderr


def test_shared_rollout_gets_each_trainers_weights(tiny_ckpt, toy_problems, tmp_path):
    """One engine shared by two trainers holds, after each construction, that trainer's merged student.
    Break checked: without the sync at construction the engine still holds trainer A's trained student: this fails."""
    from opsd.rollout import merged_state_dict
    kw = dict(model=str(tiny_ckpt), steps=1, batch_size=4, micro_batch_size=4, sampling=dict(max_tokens=6),
              log_positions=0,
              padding="aligned")
    a = OPSDTrainer(OPSDConfig.toy(run_dir=str(tmp_path / "a"), lr=1e-2, **kw), toy_problems, progress=False)
    a.step(1)                                               # A's student moves away from the base
    b = OPSDTrainer(OPSDConfig.toy(run_dir=str(tmp_path / "b"), seed=1, **kw), toy_problems, progress=False,
                    rollout=a.rollout)
    assert b.rollout is a.rollout
    held = {k: v.detach().clone() for k, v in b.rollout.gen_model.state_dict().items()}
    want, a_sd = merged_state_dict(b.unwrapped), merged_state_dict(a.unwrapped)
    assert max((want[k] - a_sd[k]).abs().max().item() for k in want) > 1e-4      # the two students differ
    for k in want: torch.testing.assert_close(held[k], want[k], rtol=0, atol=0)
    b.step(1)                                               # and B trains with it, then syncs its own update into it
    want = merged_state_dict(b.unwrapped)
    for k in want: torch.testing.assert_close(b.rollout.gen_model.state_dict()[k], want[k], rtol=0, atol=0)


def test_load_model_with_a_trained_checkpoint(tiny_ckpt, toy_problems, tmp_path):
    """`opsd.runs.load_model(base, adapter=checkpoint)` gives the trained student's logits, not the base's.
    Break checked: a loader that ignores `adapter` returns the base model and the first comparison fails."""
    from opsd.runs import load_model, latest_checkpoint, list_checkpoints
    cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "r"), steps=1, batch_size=4, micro_batch_size=4,
                         sampling=dict(max_tokens=6), log_positions=0, lr=1e-2, padding="aligned")
    tr = OPSDTrainer(cfg, toy_problems, progress=False)
    tr.fit()
    ck = latest_checkpoint(cfg.run_dir)
    assert ck.name == "step-1" and list_checkpoints(cfg.run_dir) == [(1, ck)]
    ids = torch.tensor([[5, 9, 13, 17, 21, 25]])
    with torch.no_grad():
        want = tr.unwrapped.eval()(ids).logits
        model, tok = load_model(tiny_ckpt, "float32", adapter=ck)
        got = model(ids).logits
        base = load_model(tiny_ckpt, "float32")[0](ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got - base).abs().max() > 1e-4
    assert tok.eos_token_id == tr.eos_id and not model.training


def test_fp8_rollout_needs_vllm_and_its_own_engine(tiny_ckpt, toy_problems, tmp_path):
    """`vllm.quantization` / `vllm.kv_cache` are vLLM engine settings: with the HF rollout the trainer refuses
    them, naming the fields, and a shared engine with other settings is refused rather than silently used (the bench
    keeps one engine per setting)."""
    from opsd.train import engine_settings, rollout_engine_kw
    with pytest.raises(ValueError, match="vllm.quantization='int8'"):
        OPSDConfig.toy(vllm=dict(quantization="int8"))
    cfg = OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "a"), rollout="hf",
                         vllm=dict(quantization="fp8", kv_cache="fp8"))
    assert rollout_engine_kw(cfg) == dict(quantization="fp8", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="are vLLM's; the rollout here is 'hf'"):
        OPSDTrainer(cfg, toy_problems, progress=False)
    plain = OPSDTrainer(cfg.replace(vllm=dict(quantization=None, kv_cache="auto")), toy_problems, progress=False)
    assert engine_settings(plain.rollout) == (None, "auto") and rollout_engine_kw(plain.cfg) == {}
    with pytest.raises(ValueError, match="give it an engine with its own settings"):
        OPSDTrainer(cfg.replace(run_dir=str(tmp_path / "b")), toy_problems, progress=False, rollout=plain.rollout)
