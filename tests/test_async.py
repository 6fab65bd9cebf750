"""Rollouts overlapped with training (`OPSDConfig.async_rollout`): off is the synchronous step unchanged;
on, step t trains on completions sampled from the adapter before step t-1's update (theta_{t-2}) with step t's own
problems and seed; a resumed async run equals the uninterrupted one.

Every trainer runs in float64 on CPU with one thread (bit-reproducible on one machine), so completions are compared
exactly and metrics to rel 1e-10. On CPU the next rollout runs first and the training then runs in the training
thread while the main thread waits (no overlap): the thread code is the one CUDA runs, with its device and stream calls
doing nothing; the overlap itself is checked by the GPU tests at the end (run by the lead on the H200). Each docstring
names the deliberate break made once in a working copy of opsd/train.py or opsd/overlap.py, which made the test fail."""
import json, os, subprocess
from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from opsd.runs import read_config, read_metrics
from opsd.train import OPSDConfig, OPSDTrainer
from opsd.config import upgrade_config

from conftest import venv_bin

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]

torch.set_num_threads(1)

DATA = Path(__file__).parent / "data"
# the stored regression run (tests/test_regression.py): recorded before async_rollout existed
REG_CONFIG = dict(steps=3, batch_size=4, micro_batch_size=2, sampling=dict(max_tokens=8), dtype="float64", rollout="hf",
                  lr=1e-2, tau=2e-5, seed=3, log_positions=0, save_every=100)


def numbers(row: dict) -> dict:
    "The numeric fields of a metrics row, timings left out."
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not k.startswith("time/") and k != "seconds"}


def make_trainer(ckpt, problems, run_dir, **kw) -> OPSDTrainer:
    "A float64 CPU trainer on the toy preset with a small batch and a large constant lr (the samples move each step)."
    base = dict(model=str(ckpt), run_dir=str(run_dir), steps=4, batch_size=4, micro_batch_size=4, lr=0.05,
                scheduler="constant", max_grad_norm=0.0, sampling=dict(max_tokens=10), log_positions=0, dtype="float64",
                save_every=100, padding="aligned")
    return OPSDTrainer(OPSDConfig.toy(**{**base, **kw}), problems, progress=False)


def record(tr: OPSDTrainer) -> dict:
    "Record the completions each step trains on, every generate call, and the adapter after each update."
    seen = dict(trained=[], generated=[], theta=[lora(tr)])
    bat, upd, gen = tr.batches, tr.update, tr.rollout.generate

    def batches(mine, comps):
        seen["trained"].append([list(c) for c in comps]); return bat(mine, comps)

    def update():
        out = upd(); seen["theta"].append(lora(tr)); return out

    def generate(prompts, sampling=None, **kw):
        ro = gen(prompts, sampling, **kw); seen["generated"].append([list(c) for c in ro.completion_ids]); return ro
    tr.batches, tr.update, tr.rollout.generate = batches, update, generate
    return seen


def lora(tr: OPSDTrainer) -> dict:
    "The adapter state (peft names), cloned."
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(tr.unwrapped).items()}


def test_async_off_equals_the_stored_synchronous_run(tiny_ckpt, toy_problems, tmp_path):
    """`async_rollout=False` (explicit) gives the completions and metrics of tests/data/regression_toy.json, which was
    recorded before async_rollout existed, and its rows carry no async timings. Break that made it fail: `step`
    dispatching to `_step_async` whatever the config (step 2 trains on step 2's samples from theta_0, not theta_1)."""
    want = json.loads((DATA / "regression_toy.json").read_text())
    assert upgrade_config(want["config"]) == REG_CONFIG   # stored flat: max_completion_length
    tr = OPSDTrainer(OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / "off"), async_rollout=False,
                                    **REG_CONFIG), toy_problems, progress=False)
    assert tr.cfg.vllm.sleep  # off leaves the release's sleep alone
    seen = record(tr)
    rows = [tr.step(s) for s in range(1, 4)]
    assert seen["generated"] == want["completions"]
    for s, (rw, rg) in enumerate(zip(want["metrics"], rows), 1):
        got = numbers(rg)
        assert got.keys() == rw.keys(), f"step {s}: {set(got) ^ set(rw)}"
        for k in rw: assert got[k] == pytest.approx(rw[k], rel=1e-9, abs=1e-12), f"step {s} {k}"
        assert "time/overlap" not in rg and "time/rollout_wait" not in rg


def test_async_trains_on_samples_from_two_updates_back(sharp_ckpt, toy_problems, tmp_path):
    """With async on, the completions trained on at step t equal a synchronous trainer's sample of step t (its plan
    and seed) from the adapter theta_{max(t-2, 0)} saved during the async run, and (t >= 3) differ from the sample
    from theta_{t-1} (one step of staleness is real and detected). The step's loss is the synchronous loss of those
    completions under the current weights. Break that made it fail: the next rollout launched after the sync
    (zero staleness: step t trains on theta_{t-1}'s samples)."""
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "async", async_rollout=True)
    assert tr.cfg.vllm.sleep is False  # forced: the engine stays awake beside training
    seen = record(tr)
    rows = [tr.step(s) for s in range(1, 5)]
    assert len(seen["trained"]) == 4 and len(seen["theta"]) == 5
    ref = make_trainer(sharp_ckpt, toy_problems, tmp_path / "ref")

    def sample_from(state, step):
        set_peft_model_state_dict(ref.unwrapped, state); ref.sync()
        return [list(c) for c in ref.sample(ref.plan(step)).comps]
    stale = 0
    for t in range(1, 5):
        assert seen["trained"][t - 1] == sample_from(seen["theta"][max(t - 2, 0)], t), f"step {t}"
        if t >= 3: stale += seen["trained"][t - 1] != sample_from(seen["theta"][t - 1], t)
    assert stale >= 1, "theta_{t-1} and theta_{t-2} sample the same: the test could not see zero staleness"
    # the loss of step 4: the synchronous forward of those completions under theta_3 (the weights before update 4)
    set_peft_model_state_dict(ref.unwrapped, seen["theta"][3])
    back = ref.backward_all(ref.batches(ref.plan(4).mine, seen["trained"][3]))
    assert float(back.loss_total) == pytest.approx(rows[3]["loss"], rel=1e-10)
    for r in rows:  # CPU: sequential, nothing hidden; the step's seconds count the wait
        assert r["time/overlap"] == 0.0 and r["time/rollout_wait"] > 0
        assert r["seconds"] == pytest.approx(r["time/rollout_wait"] + r["time/train"] + r["time/sync"])


def test_async_training_runs_in_the_training_thread_on_cpu(sharp_ckpt, toy_problems, tmp_path):
    """On CPU the training half of an async step that has a rollout beside it runs in the `opsd-train` thread through
    the same code as on CUDA (`opsd.overlap`; the first CUDA version's device/stream context was a tuple on CUDA only and
    failed at step 1 on the H200, while the CPU took another branch), the rollouts stay in the main thread, and the last
    step, with no rollout beside it, trains in the main thread. Break that made it fail: `Overlap.run` calling `train()`
    at once on CPU (the training then runs in MainThread)."""
    import threading
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "thr", async_rollout=True, steps=3)
    where = dict(batches=[], update=[], generate=[])
    bat, upd, gen = tr.batches, tr.update, tr.rollout.generate

    def note(kind, fn):
        def f(*a, **k):
            where[kind].append(threading.current_thread().name); return fn(*a, **k)
        return f
    tr.batches, tr.update, tr.rollout.generate = note("batches", bat), note("update", upd), note("generate", gen)
    rows = [tr.step(s) for s in range(1, 4)]
    assert where["batches"] == where["update"] == ["opsd-train", "opsd-train", "MainThread"]
    assert set(where["generate"]) == {"MainThread"} and len(where["generate"]) == 3   # steps 1, 2, 3 (none after 3)
    assert all(r["time/train"] > 0 for r in rows)


def test_async_resume_equals_uninterrupted_run(sharp_ckpt, toy_problems, tmp_path):
    """An async run stopped after step 2 and resumed from its step-2 checkpoint equals the uninterrupted async run:
    the completions trained on and every numeric metric of steps 3-4, bit for bit (the pending rollout of step 3 is
    regenerated from the stored adapter theta_1 with step 3's seed). Breaks that made it fail: `_regenerate_pending`
    returning None (the resumed step 3 samples its own batch from theta_2); regenerating from the checkpoint's theta_2
    instead of rollout_adapter.safetensors."""
    kw = dict(steps=4, save_every=2, teacher="ema", lora=dict(dropout=0.1), ema=dict(decay=0.5), micro_batch_size=2,
              lr=0.01,
              async_rollout=True)
    full, first, rest, b = stopped_and_resumed(sharp_ckpt, toy_problems, tmp_path, 2, **kw)
    assert (tmp_path / "resumed" / "checkpoints" / "step-2" / "rollout_adapter.safetensors").exists()
    assert len(full) == 4 and len(first) == 2 and len(rest) == 2
    assert [r["step"] for r in b] == [1, 2, 3, 4]


def stopped_and_resumed(ckpt, problems, tmp_path, stop: int, **kw) -> tuple:
    """Train tmp_path/full to the end, and tmp_path/resumed to `stop`, then resumed to the end, each from a new
    trainer; check that both trained on the same completions and logged the same numbers at every step. Returns the
    completions each call trained on (full, to stop, after it) and the resumed run's metrics rows."""
    def run(name, stop_after=None):
        tr = make_trainer(ckpt, problems, tmp_path / name, **kw)
        seen = record(tr)
        tr.fit(stop_after=stop_after)
        return seen["trained"]
    full = run("full")
    first = run("resumed", stop_after=stop)
    rest = run("resumed")
    assert first == full[:stop] and rest == full[stop:]
    a, b = read_metrics(tmp_path / "full").to_dicts(), read_metrics(tmp_path / "resumed").to_dicts()
    for ra, rb in zip(a, b): assert numbers(ra) == numbers(rb)
    return full, first, rest, b


def test_cli_set_async_rollout(tiny_ckpt, toy_data_file, tmp_path):
    """`opsd train --set async_rollout=true` runs async (rows log the rollout wait and overlap) and writes the forced
    `vllm.sleep: false` into the run's config. Break that made it fail: dropping the forcing line in
    `OPSDConfig.__post_init__` (the config keeps vllm.sleep true)."""
    run = tmp_path / "cli"
    cmd = [venv_bin("opsd"), "train", "--preset", "toy", "--model", str(tiny_ckpt), "--data", str(toy_data_file),
           "--run-dir", str(run), "--steps", "3", "--save-every", "2", "--batch-size", "4", "--micro-batch-size", "4",
           "--quiet", "--set", "sampling.max_tokens=6", "log_positions=0", "async_rollout=true"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    c = read_config(run)
    assert (c["async_rollout"], c["vllm"]["sleep"]) == (True, False)
    m = read_metrics(run)
    assert m["step"].to_list() == [1, 2, 3] and (m["time/overlap"] == 0).all() and (m["time/rollout_wait"] > 0).all()
    assert (run / "checkpoints" / "step-2" / "rollout_adapter.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_thread_on_cuda_same_samples_and_overlap(sharp_ckpt, toy_problems, tmp_path):
    """CUDA: the training of step t runs in a thread on its own stream while the main thread samples step t+1 (HF
    merged engine); the completions trained on equal the CPU semantics (a synchronous sample of step t from
    theta_{t-2}), and some rollout time is hidden under training. Break to try: `launch_training` running the work at
    once on CUDA too (no overlap: time/overlap stays 0)."""
    kw = dict(dtype="float32", batch_size=8, micro_batch_size=2, sampling=dict(max_tokens=32), lr=0.05, steps=4)
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "gpu", async_rollout=True, **kw)
    assert tr.acc.device.type == "cuda"
    seen = record(tr)
    rows = [tr.step(s) for s in range(1, 5)]
    ref = make_trainer(sharp_ckpt, toy_problems, tmp_path / "gref", **kw)
    for t in range(1, 5):
        set_peft_model_state_dict(ref.unwrapped, seen["theta"][max(t - 2, 0)]); ref.sync()
        assert seen["trained"][t - 1] == [list(c) for c in ref.sample(ref.plan(t)).comps], f"step {t}"
    assert sum(r["time/overlap"] for r in rows[:-1]) > 0
    assert tr.overlap.stream is not None


VLLM_ASYNC_CHILD = r'''
import json, sys
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import Qwen3Config, Qwen3ForCausalLM
from opsd.toy import toy_tokenizer, make_problems
from opsd.train import OPSDConfig, OPSDTrainer

out = sys.argv[1]
tok = toy_tokenizer()
torch.manual_seed(1)
cfg = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
                  initializer_range=0.2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
Qwen3ForCausalLM(cfg).save_pretrained(out + "/base"); tok.save_pretrained(out + "/base")
kw = dict(model=out + "/base", steps=5, batch_size=16, micro_batch_size=4, lr=0.05, scheduler="constant",
          max_grad_norm=0.0, sampling=dict(max_tokens=48), vllm=dict(memory=0.2), log_positions=0, dtype="bfloat16",
          save_every=100,
          padding="aligned", rollout="vllm")
probs = make_problems(64, seed=0, split="train")
tr = OPSDTrainer(OPSDConfig.toy(run_dir=out + "/async", async_rollout=True, **kw), probs, progress=False)
lora = lambda t: {k: v.detach().clone() for k, v in get_peft_model_state_dict(t.unwrapped).items()}
seen, theta, bat, upd = [], [lora(tr)], tr.batches, tr.update
tr.batches = lambda mine, comps: seen.append([list(c) for c in comps]) or bat(mine, comps)
tr.update = lambda: (upd(), theta.append(lora(tr)))[0]
rows = [tr.step(s) for s in range(1, 6)]
prio = dict(engine=tr.rollout.stream.priority, main=torch.cuda.current_stream().priority,
            training=tr.overlap.stream.priority)
ref = OPSDTrainer(OPSDConfig.toy(run_dir=out + "/ref", **kw), probs, progress=False, rollout=tr.rollout)
want = []
for t in range(1, 6):
    set_peft_model_state_dict(ref.unwrapped, theta[max(t - 2, 0)]); ref.sync()
    want.append([list(c) for c in ref.sample(ref.plan(t)).comps])
set_peft_model_state_dict(ref.unwrapped, theta[2]); ref.sync()
fresh3 = [list(c) for c in ref.sample(ref.plan(3)).comps]
print("RESULT " + json.dumps(dict(seen=seen, want=want, fresh3=fresh3, overlap=[r["time/overlap"] for r in rows],
                                  train=[r["time/train"] for r in rows], prio=prio)))
'''


def child_result(script: str, tmp_path) -> dict:
    "Run a test's script in a fresh Python process (a vLLM engine of its own) and parse its `RESULT {json}` line."
    import sys
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, r.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_with_vllm_samples_from_two_updates_back(tmp_path):
    """vLLM (CUDA graphs on) with async_rollout, in a fresh process: five steps run, each trains on exactly the
    completions that a synchronous step samples from theta_{t-2} in the same engine, not those of theta_{t-1}, and
    rollout time is hidden under training. Passed on the H200 (bench/h200-2026-12-04-async/test_async_vllm.log). The
    design it replaced (the rollout in a background thread) crashed with an illegal memory access at its second
    overlapped step there (bench/h200-2026-12-03-speed/run1-all). Break to try: syncing theta_t before the rollout of
    step t+1 is joined (step 3 then trains on theta_2's samples). It also checks that vLLM adopted `engine_stream`'s
    high-priority stream and that training's stream is level with it (`opsd.overlap`)."""
    pytest.importorskip("vllm")
    got = child_result(VLLM_ASYNC_CHILD, tmp_path)
    for t, (a, b) in enumerate(zip(got["seen"], got["want"]), 1):
        assert a == b, f"step {t}"
    assert got["seen"][2] != got["fresh3"]
    assert sum(got["overlap"][:-1]) > 0, got
    p = got["prio"]   # lower number = higher priority: vLLM adopted the high-priority stream made before it started
    assert p["engine"] == p["main"] == p["training"] < 0, p
