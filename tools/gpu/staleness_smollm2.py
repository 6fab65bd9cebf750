"""Arms against the released synchronous step on the real model, SmolLM2-135M-Instruct, on one GPU.
What staleness costs: one step of it (`async_rollout`, the arm `async`), a group of k steps sampled at once
(`steps_per_rollout`, the arms `k2`, `k4`), or the two together (`k4async`: a group of 4 sampled beside the previous
group's training, mean age about 2.5; the schedule of the `fast-offpolicy` recipe). The arms `entry` and `none`
instead train the release's synchronous step with that clip (finding 2's greedy accuracy against `scaled`, paired by
seed, in the same engine). What the privilege buys: the arms `noref` and `wrongref` train the scaled clip with
`teacher_context` none and wrong, `entrynoref` the entry clip with none (explanations/privilege; `entry` is its
reference arm).

The demo's SmolLM2 recipe (the world preset: 50 steps of 32 completions, scaled clip), synchronous against each arm,
over seeds, every run through `opsd.demo.run_world_jobs` (the trainer's own step) with one shared vLLM engine; then a greedy
held-out evaluation (100 problems, 128 tokens: the sampled one is uninformative for a 135M model, bench README) of the
base and of each run's last checkpoint through `opsd.eval.eval_runs` in the same engine. Prints and writes
per-run effects and the paired arm - sync differences with 95% t-intervals. Seed by seed: each seed's runs are trained,
evaluated and written to OUT_JSON before the next starts, so a call cut by its time box keeps every finished seed
(the first run, 2026-12-04, trained 5.5 of 6 runs and evaluated none).
Usage (H200, after the sets are unpacked):
    python3 tools/gpu/staleness_smollm2.py OUT_RUNS OUT_JSON [SEEDS] [--arms A,B,...] [--steps N] [--smoke]
SEEDS: a count n (seeds 0..n-1, the default 3), a range a-b or a list a,b,c (more seeds on a fresh machine without
retraining the earlier ones; pairs stay within a seed, so seeds from two calls can be pooled).
--arms: the arms (of ARMS) trained beside `sync` (default `async`); the JSON has, per measure, each arm's
interval and `diff_<arm>`, the paired arm - sync difference (the first study's file, 2026-12-04, names them `async_`
and `diff`).
--no-sync: train only the arms named (several processes on one GPU, one arm each, each with its own engine).
--engine-memory F: the engine's share of GPU memory (default 0.2; 0.1 lets five processes share one GPU).
--hf: HF generation on the GPU for the rollouts and the evaluation instead of vLLM (a machine without vLLM).
--steps N: N optimizer steps instead of the world's 50 (a multiple of 20 on the GPU: checkpoints every 10, groups of
4), the accuracy measured at step N; use another OUT_RUNS than the 50-step runs' (the run names do not say N).
--smoke: the same code on CPU at toy size (4 steps of 4 completions, 16 tokens, 4 held-out problems, HF engine), to
check the script before a GPU call; its numbers mean nothing."""
import fcntl, json, os, sys, time
from pathlib import Path

import polars as pl
from transformers import AutoTokenizer

from opsd.demo import DemoRecipe, demo_jobs, run_world_jobs, demo_frames, seed_effects
from opsd.eval import eval_runs
from opsd.plots import seed_interval
from opsd.rollout import make_rollout
from opsd.worlds import resolve_world

ARMS = {"async": {"async_rollout": True}, "k2": {"steps_per_rollout": 2}, "k4": {"steps_per_rollout": 4},
        "k4async": {"steps_per_rollout": 4, "async_rollout": True},   # k4async: the bench's fastest row (mean age 2.5)
        "entry": {}, "none": {},   # the clip arms: the release's synchronous step with another clip (`CLIP_ARMS`)
        "noref": {"teacher_context": "none"}, "wrongref": {"teacher_context": "wrong"},   # what the reference buys
        "entrynoref": {"teacher_context": "none"}}
CLIP_ARMS = {"entry", "none"}   # an arm named after a clip trains that clip; every other arm trains `scaled`, as sync
ARM_CLIP = {"entry": "entry", "none": "none", "entrynoref": "entry"}   # the clip of each arm (default scaled)
argv = sys.argv[1:]
arms = ["async"]
if "--arms" in argv:
    i = argv.index("--arms")
    if i + 1 >= len(argv): sys.exit("--arms needs a value, e.g. --arms k2,k4")
    arms = argv[i + 1].split(","); del argv[i:i + 2]
    bad = [a for a in arms if a not in ARMS and a != "sync"]
    if bad: sys.exit(f"--arms: unknown arm(s) {bad}; choose from {sorted(ARMS)}")
sync = "--no-sync" not in argv or "sync" in arms   # `--arms sync --no-sync`: the synchronous arm alone
arms = [a for a in arms if a != "sync"]
engine_memory = 0.2
if "--engine-memory" in argv:
    i = argv.index("--engine-memory")
    try: engine_memory = float(argv[i + 1])
    except (IndexError, ValueError): sys.exit("--engine-memory needs a fraction of GPU memory, e.g. --engine-memory 0.1")
    del argv[i:i + 2]
steps = None   # --steps N: a longer (or shorter) recipe than the world's 50 steps; checkpoints every 10, evaluated at N
if "--steps" in argv:
    i = argv.index("--steps")
    try: steps = int(argv[i + 1])
    except (IndexError, ValueError): sys.exit("--steps needs a whole number of optimizer steps, e.g. --steps 100")
    del argv[i:i + 2]
args = [a for a in argv if a not in ("--smoke", "--no-sync", "--hf")]
smoke = "--smoke" in argv
hf = smoke or "--hf" in argv   # --hf: the trainer's HF rollout on the GPU (no vLLM), also for the evaluation
out, dest = Path(args[0]), Path(args[1])
def parse_seeds(text: str) -> int | list[int]:
    "SEEDS: a count n (seeds 0..n-1), a range 'a-b' (a..b, both in) or a list 'a,b,c'."
    try:
        if "-" in text: a, b = (int(x) for x in text.split("-")); return list(range(a, b + 1))
        if "," in text: return [int(x) for x in text.split(",")]
        return int(text)
    except ValueError: sys.exit(f"SEEDS must be a count, a range a-b or a list a,b,c; got {text!r}")
seeds = parse_seeds(args[2]) if len(args) > 2 else 3
t_all = time.perf_counter()
w = resolve_world("smollm2")
recipe = DemoRecipe(k=1)   # the demo's own evaluation (the world's: greedy); the one below at steps 0 and `last` is the measure
if smoke:
    recipe = DemoRecipe(k=1, n_eval=4, config=dict(steps=4, batch_size=4, micro_batch_size=4,
                                                   sampling=dict(max_tokens=16), save_every=4, rollout="hf"))
n_test, last, new_tokens = (4, 4, 16) if smoke else (100, 50, 128)
if hf and not smoke: recipe = recipe.with_config(rollout="hf")
if steps is not None:   # the last checkpoint is the measure; every arm of the study gets the same length
    unit = 4 if smoke else 20   # whole groups of 4 (the k4 arms), and on the GPU a checkpoint every 10 steps
    if steps < unit or steps % unit: sys.exit(f"--steps must be a multiple of {unit} here, got {steps}")
    recipe, last = recipe.with_config(steps=steps, save_every=4 if smoke else 10), steps
jobs = []
for label, extra in ([("sync", {})] if sync else []) + [(a, ARMS[a]) for a in arms]:
    clip = ARM_CLIP.get(label, "scaled")
    for j in demo_jobs(out, clips=[clip], seeds=seeds, recipe=recipe, world="smollm2", **extra):
        j["name"] = f"smollm2-{clip}-{'sync' if label in CLIP_ARMS else label}-s{j['seed']}"   # entry: smollm2-entry-sync-s0
        j["run_dir"], j["label"] = str(out / j["name"]), label
        jobs.append(j)
jobs.sort(key=lambda j: (j["seed"], j["label"]))   # seed-major: a cut call leaves whole seeds
path = w.path
tok = AutoTokenizer.from_pretrained(path)
t0 = time.perf_counter()
# Several processes on one GPU (tools/gpu/privilege.sh): ENGINE_LOCK makes their engines start one at a time, and
# BARRIER=DIR:N holds each process until N engines are up, so no engine profiles its memory while another process
# allocates or frees (vLLM reads the device's free memory then).
lock = open(os.environ["ENGINE_LOCK"], "w") if os.environ.get("ENGINE_LOCK") and not hf else None
if lock: fcntl.flock(lock, fcntl.LOCK_EX)
try:
    engine = None if hf else make_rollout("vllm", None, tok, path, max_model_len=1024, gpu_memory_utilization=engine_memory,
                                             sleep=False, seed=0, progress=False, merged=True)
finally:
    if lock: fcntl.flock(lock, fcntl.LOCK_UN)
    if os.environ.get("BARRIER") and not hf:   # arrive (also when the engine failed: the others must not wait)
        bdir, n = os.environ["BARRIER"].rsplit(":", 1)
        Path(bdir).mkdir(parents=True, exist_ok=True); (Path(bdir) / str(os.getpid())).touch()
        t_wait = time.time()
        while len(list(Path(bdir).iterdir())) < int(n) and time.time() - t_wait < 400: time.sleep(1)
print(f"engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
test_set = w.problems(n_test, seed=10_000, split="test")
prompt_cfg = w.prompt_config(None)
greedy = w.eval_sampling(0, max_new_tokens=new_tokens)   # the world's greedy setting: the demo's rows of it are reused


def arm_of(run: str) -> str | None:
    """The arm of a run folder's name (smollm2-scaled-k4async-s3: k4async; smollm2-entry-sync-s0: entry): runs an earlier
    call left in OUT_RUNS are summarized with this call's (pairs stay within a seed)."""
    parts = run.split("-")
    if len(parts) != 4 or parts[0] != "smollm2": return None
    return parts[1] if parts[2] == "sync" and parts[1] in CLIP_ARMS else parts[2]


def summarize(done: list) -> dict:
    "Per-run effects, step times and the paired arm - sync differences of the runs evaluated so far."
    metrics, evals, _ = demo_frames(out)
    evals = evals.filter(pl.col("key_temperature") == 0.0, pl.col("key_n") == n_test,   # the measure's setting only
                         pl.col("key_max_new_tokens") == new_tokens)
    arm = pl.col("run").map_elements(arm_of, return_dtype=pl.String).alias("variant")
    fx = seed_effects(metrics, evals).with_columns(arm)
    m = metrics.with_columns(arm)
    late = pl.col("step") > 1   # step times after the first (warm-up); the rollout age over every step
    speed = m.group_by("variant").agg(pl.col("seconds").filter(late).median().alias("median_s_per_step"),
                                      pl.col("time/rollout").filter(late).median().alias("median_rollout_s"),
                                      pl.col("time/train").filter(late).median().alias("median_train_s"),
                                      pl.col("rollout_age").mean().alias("mean_rollout_age"))
    res = dict(runs=fx.select("run", "variant", "seed", "acc_base", "acc_change", "kl_first", "kl_change").to_dicts(),
               speed=speed.to_dicts(), train=done, seconds=round(time.perf_counter() - t_all, 1))
    w_ = (fx.filter(pl.col("variant").is_in(["sync", *arms]))   # other arms in the folder would drop seeds they lack
          .pivot(on="variant", index="seed", values=["acc_change", "kl_change"]).drop_nulls().sort("seed"))
    for name in ("acc_change", "kl_change"):
        if w_.height == 0 or f"{name}_sync" not in w_.columns: break
        s = w_[f"{name}_sync"].to_list()
        res[name] = dict(sync=seed_interval(s))
        for arm in arms:
            if f"{name}_{arm}" not in w_.columns: continue
            a = w_[f"{name}_{arm}"].to_list()   # drop_nulls above: only seeds with every arm evaluated
            res[name][arm] = seed_interval(a)
            res[name][f"diff_{arm}"] = seed_interval([x - y for x, y in zip(a, s)])
    return res


done = []
for seed in sorted({j["seed"] for j in jobs}):
    pair = [j for j in jobs if j["seed"] == seed]   # sync and each arm
    done += run_world_jobs(pair, progress=True, engine=engine)
    t0 = time.perf_counter()
    eval_runs([j["run_dir"] for j in pair], test_set, model_path=path, k=1, seeds=(0,), steps=[0, last],
              backend=engine or "hf", max_new_tokens=new_tokens, grade_mode=w.grade_mode, prompt_cfg=prompt_cfg,
              dtype=w.eval_dtype, sampling=greedy, progress=False)
    print(f"seed {seed}: greedy eval {time.perf_counter() - t0:.0f} s", flush=True)
    res = summarize(done)
    dest.write_text(json.dumps(res, indent=1, default=float))   # after every pair: a cut call keeps what finished
print(json.dumps({k: v for k, v in res.items() if k != "train"}, indent=1, default=float))
