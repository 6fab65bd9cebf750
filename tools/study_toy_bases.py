"""The toy clip study over bases and seeds: `opsd demo --clips entry scaled none` on SFT seeds 0, 1, 2 of the soft base.

    python tools/study_toy_bases.py [--bases 0 1 2] [--seeds 3] [--out runs/study-toy-bases]

Runs go to the (ignored) `--out` folder; `python -m opsd.results add toy-clips runs/study-toy-bases ...` copies
their raw data into the results store.
Base 0 is the demo's own base: its folder equals what `opsd demo --clips entry scaled none` writes.
"""
import argparse, json, time
from opsd.demo import run_demo

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--bases", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", type=int)
    p.add_argument("--out", default="runs/study-toy-bases")
    a = p.parse_args()
    for b in a.bases:
        t0 = time.perf_counter()
        run_demo(f"{a.out}/base{b}", teachers=["soft"], clips=["entry", "scaled", "none"], seeds=a.seeds,
                 toy=None if b == 0 else {"seed": b}, workers=a.workers, png=False, report=False)
        print(json.dumps(dict(base_seed=b, seconds=round(time.perf_counter() - t0))), flush=True)
