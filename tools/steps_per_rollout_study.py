#!/usr/bin/env python
"""The staleness study of `steps_per_rollout` on the toy world (nbs/explanations/steps_per_rollout.ipynb):

    python tools/steps_per_rollout_study.py [OUT] [SEEDS] [LR] [--arms k1,k2,k4]
    (defaults: runs/steps_per_rollout 10, the demo's lr, the arms k1, k2, k4)

The demo's `scaled` cell (`DemoRecipe()`, the toy base of `opsd demo`, 100 steps of 32 completions, held-out avg@2 at
steps 0/25/50/75/100) with 1, 2 and 4 steps per rollout over seeds 0..SEEDS-1, two worker processes (`run_study`;
finished runs in OUT are kept, not retrained); LR replaces the recipe's learning rate (the stress test: a policy that
moves more per update). Then writes what the notebook reads, next to it: steps_per_rollout[_lrLR]_effects.csv (one
row per run: `seed_effects`) and steps_per_rollout[_lrLR]_steps.csv (per run and step: loss, true KL, the clipped
teacher-argmax share, the rollout's age). --arms picks arms of ARMS (`k4async`: 4 steps per rollout with the next group
sampled beside training, `async_rollout`, the bench's fastest row); a list other than the default writes
steps_per_rollout_<arms joined by _>[_lrLR]_{effects,steps}.csv."""
import sys
from pathlib import Path

import polars as pl

from opsd.demo import DemoRecipe, demo_frames, run_study

ARMS = {"k1": {}, "k2": dict(steps_per_rollout=2), "k4": dict(steps_per_rollout=4),
        "k4async": dict(steps_per_rollout=4, async_rollout=True)}
DEFAULT = ["k1", "k2", "k4"]
NB = Path(__file__).resolve().parents[1] / "nbs" / "explanations"

if __name__ == "__main__":   # the study's worker processes are spawned: they import this file
    argv, arms = sys.argv[1:], DEFAULT
    if "--arms" in argv:
        i = argv.index("--arms")
        if i + 1 >= len(argv): sys.exit("--arms needs a value, e.g. --arms k1,k4async")
        arms = argv[i + 1].split(","); del argv[i:i + 2]
        if bad := [a for a in arms if a not in ARMS]: sys.exit(f"--arms: unknown arm(s) {bad}; choose from {list(ARMS)}")
    out = Path(argv[0] if argv else "runs/steps_per_rollout")
    seeds = int(argv[1]) if len(argv) > 1 else 10
    lr = float(argv[2]) if len(argv) > 2 else None
    r = DemoRecipe() if lr is None else DemoRecipe().with_config(lr=lr)
    res = run_study(out, "soft", [(arm, "scaled", r.with_config(**ARMS[arm]) if ARMS[arm] else r) for arm in arms],
                    seeds=seeds, workers=2)
    stem = "steps_per_rollout" + ("" if arms == DEFAULT else "_" + "_".join(arms)) + ("" if lr is None else f"_lr{lr:g}")
    fx = res["effects"].rename({"variant": "arm"})
    fx.select([c for c in fx.columns if fx[c].dtype != pl.Object]).write_csv(NB / f"{stem}_effects.csv")
    m, _, _ = demo_frames(out)
    keep = ["run", "seed", "step", "loss", "kl/true", "entry/argmax_clipped_frac", "rollout_age"]
    m = m.filter(pl.col("run").is_in(fx["run"].to_list())).select(keep)
    m = m.with_columns(pl.col("run").str.extract(r"-(k\d(?:async)?)-").alias("arm")).sort("run", "step")
    m.write_csv(NB / f"{stem}_steps.csv", float_precision=6)
    print(f"wrote {NB / (stem + '_effects.csv')} ({fx.height} runs) and {stem}_steps.csv ({m.height} rows)")
