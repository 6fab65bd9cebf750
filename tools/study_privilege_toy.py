"""The toy privilege study: does the teacher need the reference? `teacher_context` arms on the demo's soft base.

    python tools/study_privilege_toy.py [--arms scaled:none scaled:wrong entry:none] [--seeds 3] [--workers 2]
                                        [--out runs/privilege-toy] [--check-reference]

Each arm CLIP:CONTEXT trains the demo's recipe (`opsd demo`: 100 steps, lr 3e-3, aligned padding, held-out accuracy
avg@2 on 200 problems at steps 0, 25, 50, 75, 100) with that clip and teacher context, seeds 0..n-1. The reference
arms (scaled:reference, entry:reference) are the runs of the `toy-clips` study's base 0 (the same jobs: `opsd demo
--clips entry scaled none`), so by default only the new arms train; `--check-reference` first retrains the first two
steps of soft-scaled-s0 and soft-entry-s0 here and checks that their metrics equal the stored runs' (the same trainer
step, the same arithmetic), which is what lets the new arms pair with the stored ones seed by seed.
Runs go to the (ignored) `--out` folder; `python -m opsd.results add toy-privilege OUT ...` copies their raw data
into the results store.
"""
import argparse, json, math, shutil, tempfile, time
from pathlib import Path

import polars as pl

from opsd.data import TEACHER_CONTEXTS
from opsd.demo import DemoRecipe, run_study, demo_jobs, job_config, _toy_base
from opsd.results import store_dir


def check_reference(clips=("scaled", "entry"), steps=2) -> None:
    "Retrain the first `steps` steps of the stored base-0 reference runs of seed 0 and compare every metric."
    from opsd.toy import make_problems, toy_config, TOY_PROMPT
    from opsd.train import OPSDTrainer
    from opsd.eval import grade
    tmp = Path(tempfile.mkdtemp())
    for clip in clips:
        job = demo_jobs(tmp, ["soft"], [clip], [0], DemoRecipe())[0]
        stored = pl.read_parquet(store_dir() / "toy-clips" / "base0" / job["name"] / "metrics.parquet")
        cfg = job_config(job)
        train_set = make_problems(2000, seed=0, split="train", **toy_config("soft").problem_kw())
        OPSDTrainer(cfg, train_set, model_path=str(_toy_base("soft")), grader=lambda t, a: grade(t, a, mode="exact"),
                    prompt_config=TOY_PROMPT, progress=False).fit(resume=False, stop_after=steps)
        mine = pl.read_ndjson(Path(cfg.run_dir) / "metrics.jsonl")
        skip = {"seconds", "run"} | {c for c in mine.columns if c.startswith("time/")}
        for s in range(1, steps + 1):
            a = mine.filter(pl.col("step") == s).row(0, named=True)
            b = stored.filter(pl.col("step") == s).row(0, named=True)
            diff = {k: (a[k], b.get(k)) for k in a if k not in skip and isinstance(a[k], float)
                    and not (b.get(k) == a[k] or (math.isnan(a[k]) and math.isnan(b.get(k, 0.0))))}
            if diff: raise SystemExit(f"{job['name']} step {s} differs from the stored run: {diff}")
        print(json.dumps(dict(check=job["name"], steps=steps, equal=True)), flush=True)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--arms", nargs="+", default=["scaled:none", "scaled:wrong", "entry:none"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", type=int)
    p.add_argument("--out", default="runs/privilege-toy")
    p.add_argument("--check-reference", action="store_true")
    a = p.parse_args()
    arms = [tuple(x.split(":")) for x in a.arms]
    bad = [x for x in arms if len(x) != 2 or x[1] not in TEACHER_CONTEXTS]
    if bad: raise SystemExit(f"--arms: each arm is CLIP:CONTEXT with CONTEXT one of {TEACHER_CONTEXTS}; got {bad}")
    if a.check_reference: check_reference()
    t0 = time.perf_counter()
    variants = [(ctx, clip, DemoRecipe().with_config(teacher_context=ctx)) for clip, ctx in arms]
    run_study(a.out, "soft", variants, seeds=a.seeds, workers=a.workers)
    print(json.dumps(dict(arms=a.arms, seeds=a.seeds, seconds=round(time.perf_counter() - t0))), flush=True)
