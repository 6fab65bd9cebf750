#!/usr/bin/env python
"""The staleness study of `steps_per_rollout` on the toy world (nbs/explanations/steps_per_rollout.ipynb):

    python tools/steps_per_rollout_study.py [OUT] [SEEDS] [LR]     (defaults: runs/steps_per_rollout 10, the demo's lr)

The demo's `scaled` cell (`DemoRecipe()`, the toy base of `opsd demo`, 100 steps of 32 completions, held-out avg@2 at
steps 0/25/50/75/100) with 1, 2 and 4 steps per rollout over seeds 0..SEEDS-1, two worker processes (`run_study`;
finished runs in OUT are kept, not retrained); LR replaces the recipe's learning rate (the stress test: a policy that
moves more per update). Then writes what the notebook reads, next to it: steps_per_rollout[_lrLR]_effects.csv (one
row per run: `seed_effects`) and steps_per_rollout[_lrLR]_steps.csv (per run and step: loss, true KL, the clipped
teacher-argmax share, the rollout's age)."""
import sys
from pathlib import Path

import polars as pl

from opsd.demo import DemoRecipe, demo_frames, run_study

ARMS = {"k1": 1, "k2": 2, "k4": 4}
NB = Path(__file__).resolve().parents[1] / "nbs" / "explanations"

if __name__ == "__main__":   # the study's worker processes are spawned: they import this file
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/steps_per_rollout")
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else None
    r = DemoRecipe() if lr is None else DemoRecipe().with_config(lr=lr)
    res = run_study(out, "soft", [(arm, "scaled", r if k == 1 else r.with_config(steps_per_rollout=k))
                                  for arm, k in ARMS.items()], seeds=seeds, workers=2)
    stem = "steps_per_rollout" + ("" if lr is None else f"_lr{lr:g}")
    fx = res["effects"].rename({"variant": "arm"})
    fx.select([c for c in fx.columns if fx[c].dtype != pl.Object]).write_csv(NB / f"{stem}_effects.csv")
    m, _, _ = demo_frames(out)
    keep = ["run", "seed", "step", "loss", "kl/true", "entry/argmax_clipped_frac", "rollout_age"]
    m = m.filter(pl.col("run").is_in(fx["run"].to_list())).select(keep)
    m = m.with_columns(pl.col("run").str.extract(r"-(k\d)-").alias("arm")).sort("run", "step")
    m.write_csv(NB / f"{stem}_steps.csv", float_precision=6)
    print(f"wrote {NB / (stem + '_effects.csv')} ({fx.height} runs) and {stem}_steps.csv ({m.height} rows)")
