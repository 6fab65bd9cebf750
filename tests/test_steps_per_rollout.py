"""Several steps per rollout (`OPSDConfig.steps_per_rollout`): one engine call samples the completions of k
steps from the weights before the first of them, and each step trains on its share. 1 is the release (every step
samples its own; tests/test_regression.py and test_async.py check that against runs recorded before the option).

Float64 trainers on CPU with one thread, so completions are compared exactly and metrics to rel 1e-10. The references
are built by hand: the engine's `generate` on the concatenated prompts of the group's plans, with the first step's
seed, from the adapter saved before that step. Each docstring names the deliberate break made once in a working copy
of opsd/train.py, which made the test fail."""
import dataclasses, json

import pytest
import torch
from peft.utils import set_peft_model_state_dict

from opsd.train import OPSDConfig

from test_async import VLLM_ASYNC_CHILD, child_result, make_trainer, record, stopped_and_resumed

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]

torch.set_num_threads(1)


def by_hand(ref, state, steps: list[int]) -> dict[int, list[list[int]]]:
    "The completions of `steps` from one generate call on their concatenated prompts, seeded by the first step."
    set_peft_model_state_dict(ref.unwrapped, state); ref.sync()
    plans = [ref.plan(s) for s in steps]
    sampling = dataclasses.replace(ref.sampling, seed=ref.cfg.seed * 100003 + steps[0])
    ro = ref.rollout.generate([ref.prompts(i)[0] for p in plans for i in p.idx], sampling)
    n = len(plans[0].idx)
    return {s: [list(c) for c in ro.completion_ids[j * n:(j + 1) * n]] for j, s in enumerate(steps)}


def run_steps(tr, n: int) -> tuple[list[dict], list[int]]:
    "Steps 1..n: their metrics rows, and for each weight sync to the engine the number of steps finished before it."
    done, syncs, sync = [0], [], tr.sync
    tr.sync = lambda: (syncs.append(done[0]), sync())[1]
    rows = []
    for s in range(1, n + 1):
        rows.append(tr.step(s)); done[0] = s
    return rows, syncs


def test_group_of_two_samples_once_from_the_weights_before_its_first_step(sharp_ckpt, toy_problems, tmp_path):
    """steps_per_rollout=2 over 4 steps: two engine calls (steps 1 and 3) of 2 x batch prompts; the completions that
    steps 1-2 and 3-4 train on equal a by-hand generate of both plans from theta_0 and theta_2; step 4's differ from
    what theta_3 samples (the staleness is real); `rollout_age` is 0, 1, 0, 1; the weights go to the engine only after
    steps 2 and 4; step 4's loss is the synchronous loss of its completions under theta_3. Breaks that made it fail:
    `sample` ignoring the pending rollout (four engine calls, ages 0); syncing after every step (syncs after 1-4)."""
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "k2", steps_per_rollout=2)
    seen = record(tr)
    rows, syncs = run_steps(tr, 4)
    assert [len(g) for g in seen["generated"]] == [8, 8]          # two calls, each of two steps' 4 prompts
    assert [r["rollout_age"] for r in rows] == [0, 1, 0, 1]
    assert syncs == [1, 3], syncs                                 # during steps 2 and 4, after their update
    ref = make_trainer(sharp_ckpt, toy_problems, tmp_path / "ref")
    want = {**by_hand(ref, seen["theta"][0], [1, 2]), **by_hand(ref, seen["theta"][2], [3, 4])}
    for t in range(1, 5): assert seen["trained"][t - 1] == want[t], f"step {t}"
    fresh = by_hand(ref, seen["theta"][3], [4])[4]
    assert seen["trained"][3] != fresh, "theta_2 and theta_3 sample the same: the test could not see the staleness"
    set_peft_model_state_dict(ref.unwrapped, seen["theta"][3])
    back = ref.backward_all(ref.batches(ref.plan(4).mine, seen["trained"][3]))
    assert float(back.loss_total) == pytest.approx(rows[3]["loss"], rel=1e-10)
    assert rows[1]["time/rollout"] < rows[0]["time/rollout"] / 10   # step 2 took its completions, it sampled nothing


def test_resume_inside_a_group_equals_the_uninterrupted_run(sharp_ckpt, toy_problems, tmp_path):
    """steps_per_rollout=3 over 6 steps, checkpoints every 2: a run stopped after step 2 (inside the group of steps
    1-3) and resumed equals the uninterrupted run: the completions trained on and every numeric metric of steps 3-6
    (the group is sampled again from the stored adapter theta_0, in one call of steps 1-3, and steps 1-2 dropped).
    Break that made it fail: `_regenerate_pending` returning None (the resumed step 3 samples a new group from
    theta_2)."""
    full, _, _, b = stopped_and_resumed(sharp_ckpt, toy_problems, tmp_path, 2, steps=6, save_every=2,
                                        steps_per_rollout=3, micro_batch_size=2, lr=0.01)
    ck = tmp_path / "resumed" / "checkpoints" / "step-2"
    assert json.loads((ck / "rollout_group.json").read_text()) == dict(steps=[1, 2, 3], at=1)
    assert (ck / "rollout_adapter.safetensors").exists()
    assert len(full) == 6 and [r["step"] for r in b] == list(range(1, 7))
    assert [r["rollout_age"] for r in b] == [0, 1, 2, 0, 1, 2]


def test_async_group_samples_beside_the_last_step_of_the_group_before(sharp_ckpt, toy_problems, tmp_path):
    """async_rollout with steps_per_rollout=2 over 4 steps: step 1 samples steps 1-2 from theta_0 first; beside step
    2's training the engine samples steps 3-4 from theta_1 (one call); ages 0, 1, 1, 2; the weights go to the engine
    after steps 1 and 3 (before the steps that sample) and at the end. Break that made it fail: no sync before a
    step that samples beside its training (the `p.steps[-1] == step + 1` clause dropped: steps 3-4 from theta_0)."""
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "ak2", steps_per_rollout=2, async_rollout=True)
    seen = record(tr)
    rows, syncs = run_steps(tr, 4)
    assert [len(g) for g in seen["generated"]] == [8, 8]
    assert [r["rollout_age"] for r in rows] == [0, 1, 1, 2]
    assert syncs == [0, 2, 3], syncs                               # during steps 1, 3 and 4
    ref = make_trainer(sharp_ckpt, toy_problems, tmp_path / "ref")
    want = {**by_hand(ref, seen["theta"][0], [1, 2]), **by_hand(ref, seen["theta"][1], [3, 4])}
    for t in range(1, 5): assert seen["trained"][t - 1] == want[t], f"step {t}"
    assert want[3] != by_hand(ref, seen["theta"][2], [3, 4])[3], "theta_1 and theta_2 sample the same"


def test_steps_per_rollout_below_one_refused():
    "0 steps per rollout is refused naming the field."
    with pytest.raises(ValueError, match="steps_per_rollout=0"):
        OPSDConfig(steps_per_rollout=0)


# test_async's child up to its trainer: the tiny bf16 Qwen3 saved with the toy tokenizer, `kw` (vLLM, 5 steps), problems
VLLM_GROUP_CHILD = "import dataclasses\n" + VLLM_ASYNC_CHILD.split("tr = OPSDTrainer")[0] + r'''
kw["steps"] = 4
tr = OPSDTrainer(OPSDConfig.toy(run_dir=out + "/k2", steps_per_rollout=2, **kw), probs, progress=False)
lora = lambda t: {k: v.detach().clone() for k, v in get_peft_model_state_dict(t.unwrapped).items()}
seen, theta, calls, bat, upd, gen = [], [lora(tr)], [], tr.batches, tr.update, tr.rollout.generate
tr.batches = lambda mine, comps: seen.append([list(c) for c in comps]) or bat(mine, comps)
tr.update = lambda: (upd(), theta.append(lora(tr)))[0]
tr.rollout.generate = lambda prompts, sampling=None, **k: (calls.append(len(prompts)), gen(prompts, sampling, **k))[1]
rows = [tr.step(s) for s in range(1, 5)]
tr.rollout.generate = gen
ref = OPSDTrainer(OPSDConfig.toy(run_dir=out + "/ref", **kw), probs, progress=False, rollout=tr.rollout)
def by_hand(state, steps):
    set_peft_model_state_dict(ref.unwrapped, state); ref.sync()
    plans = [ref.plan(s) for s in steps]
    sampling = dataclasses.replace(ref.sampling, seed=ref.cfg.seed * 100003 + steps[0])
    ro = ref.rollout.generate([ref.prompts(i)[0] for p in plans for i in p.idx], sampling)
    n = len(plans[0].idx)
    return [[list(c) for c in ro.completion_ids[j * n:(j + 1) * n]] for j in range(len(steps))]
want = by_hand(theta[0], [1, 2]) + by_hand(theta[2], [3, 4])
print("RESULT " + json.dumps(dict(seen=seen, want=want, calls=calls, ages=[r["rollout_age"] for r in rows],
                                  rollout=[r["time/rollout"] for r in rows])))
'''


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steps_per_rollout_with_vllm(tmp_path):
    """vLLM (CUDA graphs on, the engine asleep during training as released) with steps_per_rollout=2, in a fresh
    process: four steps make two engine calls of 32 prompts, and each step trains on exactly the rows of a by-hand
    `generate` of both plans' prompts from the adapter before the group (vLLM's per-prompt seeds repeat), ages 0, 1,
    0, 1. Written without a GPU (2026-12-05); runs with `speed.sh steps`."""
    pytest.importorskip("vllm")
    got = child_result(VLLM_GROUP_CHILD, tmp_path)
    assert got["calls"] == [32, 32] and got["ages"] == [0, 1, 0, 1], got
    for t, (a, b) in enumerate(zip(got["seen"], got["want"]), 1):
        assert a == b, f"step {t}"


def test_resumed_inside_a_group_the_engine_sleeps_through_training(sharp_ckpt, toy_problems, tmp_path):
    """With `vllm.sleep` (the release's: the engine frees its GPU memory while training runs), a run resumed inside a
    group samples the group again and syncs the current weights, both of which wake the engine; the next steps only
    train, so the engine must be put back to sleep before them. Break that made it fail: the `sleep` line at the end
    of `resume` dropped (the last engine event is the sync)."""
    kw = dict(steps=4, save_every=1, steps_per_rollout=3, micro_batch_size=2)
    make_trainer(sharp_ckpt, toy_problems, tmp_path / "run", **kw).fit(stop_after=1)
    tr = make_trainer(sharp_ckpt, toy_problems, tmp_path / "run", **kw)
    assert tr.cfg.vllm.sleep
    events, ro = [], tr.rollout
    for name in ("sleep", "sync_weights", "generate"):
        f = getattr(ro, name)
        setattr(ro, name, lambda *a, _f=f, _n=name, **k: (events.append(_n), _f(*a, **k))[1])
    assert tr.resume() == 1 and sorted(tr._pending.samples) == [2, 3]
    assert events.index("generate") < len(events) - 1 and events[-1] == "sleep", events


def test_fresh_kl_reproduces_a_logged_step(sharp_ckpt, toy_problems, tmp_path):
    """tools/fresh_kl.py measures a checkpoint's own samples through the trainer's own code: from step 2's checkpoint of
    a release run (k = 1), step 3's problems give step 3's logged kl/true, clipped teacher-argmax share and token count
    (same weights, problems and sampling seed), exactly. Break that made it fail: the measuring trainer's teacher set
    to 'live' (the adapters left on in the teacher pass)."""
    import importlib.util
    from pathlib import Path
    from opsd.runs import read_metrics
    spec = importlib.util.spec_from_file_location("fresh_kl", Path(__file__).parents[1] / "tools" / "fresh_kl.py")
    fk = importlib.util.module_from_spec(spec); spec.loader.exec_module(fk)
    run = tmp_path / "run"
    make_trainer(sharp_ckpt, toy_problems, run, steps=3, save_every=2).fit()
    logged = read_metrics(run).filter(step=3).row(0, named=True)
    got = fk.fresh_rows(run, [3], at=2, model_path=str(sharp_ckpt), problems=toy_problems, prompt_config=None)
    assert len(got) == 1 and got[0]["at"] == 2 and got[0]["tokens"] == logged["tokens"]
    assert got[0]["kl_fresh"] == pytest.approx(logged["kl/true"], rel=1e-10, abs=0)
    assert got[0]["argmax_clipped_fresh"] == pytest.approx(logged["entry/argmax_clipped_frac"], rel=1e-10, abs=0)
    assert logged["kl/true"] > 1e-3, "teacher and student must differ for the check to mean anything"
