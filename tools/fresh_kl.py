#!/usr/bin/env python
"""The policy's own true KL at the end of a toy study's runs, on fresh samples (nbs/explanations/steps_per_rollout):

    python tools/fresh_kl.py RUNS OUT.csv [STEPS] [--at K]
    (STEPS: the steps whose problems are re-sampled, default 91-100; --at K: checkpoint step-K, default the last)

The trainer logs `kl/true` on the completions each step trains on; with `steps_per_rollout` or `async_rollout` those
come from older weights, so a stale arm's logged KL mixes the policy's drift with off-policy measurement. Here, for each
run folder under RUNS (a `run_study` folder of the toy world), the run's own config builds an `OPSDTrainer` (its
`steps_per_rollout` and `async_rollout` set to the release's, its run folder a temporary one), the last checkpoint's
adapter is loaded with `load_checkpoint`, and for each step of STEPS the trainer's own code samples that step's problems
from the final weights (`_generate`, seeded by the step) and measures them (`batches`, `forward_loss` under no_grad:
the same teacher pass and instruments as training, no update). Writes one row per run and step (kl/true, the clipped
teacher-argmax share, tokens) to OUT.csv. The check of the tool: for a k = 1 run, `--at 75` with STEPS 76-76 must give
the logged kl/true of step 76 (same weights, problems and sampling seed); tests/test_steps_per_rollout.py checks the
same on a tiny float64 run."""
import sys, tempfile
from pathlib import Path

import polars as pl
import torch

from opsd.demo import _toy_base
from opsd.diagnostics import diagnostic_sums
from opsd.runs import checkpoint_step, latest_checkpoint, read_config
from opsd.toy import TOY_PROMPT, make_problems, toy_config
from opsd.train import OPSDConfig, OPSDTrainer, load_checkpoint


def fresh_rows(run_dir: Path, steps, at: int | None = None, model_path: str | None = None,
               problems: list[dict] | None = None, prompt_config=TOY_PROMPT) -> list[dict]:
    """kl/true and the clipped teacher-argmax share of a checkpoint's own samples of `steps`' problems (default: the
    last checkpoint; the toy study's base, training problems and prompt; tests pass their own)."""
    cfg = OPSDConfig.from_dict(read_config(run_dir), source=str(run_dir / "config.json"))
    ck = latest_checkpoint(run_dir) if at is None else run_dir / "checkpoints" / f"step-{at}"
    if ck is None or not ck.exists() or (at is None and checkpoint_step(ck) != cfg.steps):
        raise ValueError(f"{run_dir}: no checkpoint {'of the last step' if at is None else ck.name}; train the run first")
    if model_path is None:   # the study's toy world and base (run_study of tools/steps_per_rollout_study.py)
        model_path = str(_toy_base("soft", {}))
        problems = make_problems(2000, seed=cfg.seed, split="train", **toy_config("soft").problem_kw())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mcfg = cfg.replace(run_dir=tmp, steps_per_rollout=1, async_rollout=False)
        tr = OPSDTrainer(mcfg, problems, model_path=model_path, prompt_config=prompt_config, progress=False)
        load_checkpoint(ck, tr.unwrapped, tr.optimizer, tr.scheduler, tr.teacher)
        tr.sync()                                    # the rollout engine samples from the loaded adapter
        tr.model.eval()
        for s in steps:
            plan = tr.plan(s)
            samples = tr._generate(plan)
            sums = {}
            with torch.no_grad():
                for b in tr.batches(plan.mine, samples.comps):
                    _, diag = tr.forward_loss(b)
                    for k, v in diagnostic_sums(diag).items(): sums[k] = sums.get(k, 0) + float(v)
            n = max(sums.pop("count"), 1.0)
            rows.append(dict(run=run_dir.name, seed=cfg.seed, at=checkpoint_step(ck), step=s, tokens=int(n),
                             kl_fresh=sums["kl/true"] / n, argmax_clipped_fresh=sums["entry/argmax_clipped_frac"] / n))
    return rows


if __name__ == "__main__":
    argv, at = sys.argv[1:], None
    if "--at" in argv:
        i = argv.index("--at"); at = int(argv[i + 1]); del argv[i:i + 2]
    runs, out = Path(argv[0]), Path(argv[1])
    lo, hi = map(int, (argv[2] if len(argv) > 2 else "91-100").split("-"))
    torch.set_num_threads(2)
    rows = []
    for d in sorted(p for p in runs.iterdir() if (p / "config.json").exists()):
        rows += fresh_rows(d, range(lo, hi + 1), at)
        print(d.name, round(sum(r["kl_fresh"] for r in rows[-(hi - lo + 1):]) / (hi - lo + 1), 4), flush=True)
    pl.DataFrame(rows).write_csv(out, float_precision=6)
    print(f"wrote {out} ({len(rows)} rows)")
