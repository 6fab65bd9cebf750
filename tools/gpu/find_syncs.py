"""Where the training half waits for the device: one step of the `fast` recipe on a Qwen3 checkpoint under
torch.cuda.set_sync_debug_mode('warn'); prints each synchronizing call's stack once with its count."""
import sys, collections, traceback, warnings
import torch
from opsd.train import OPSDConfig, OPSDTrainer
from opsd.bench import bench_problems, E2E_COMMON
from opsd.recipes import load_recipe
from opsd.config import merge_config
model = sys.argv[1]
cfg = OPSDConfig(**merge_config(E2E_COMMON, load_recipe("fast"), dict(
    model=model, run_dir="/tmp/fs/run", name="fs", rollout="hf", batch_size=8, micro_batch_size=4,
    sampling=dict(max_tokens=32), seed=0)))
tr = OPSDTrainer(cfg, bench_problems(16), model_path=model, progress=False)
tr.step(1)
seen = collections.Counter(); first = {}
def hook(message, category, filename, lineno, file=None, line=None):
    st = "".join(traceback.format_stack(limit=14)[:-2])
    seen[st] += 1; first.setdefault(st, str(message)[:120])
warnings.showwarning = hook
back, upd = tr.backward_all, tr.update
def wrap(fn):
    def run(*a, **k):
        torch.cuda.set_sync_debug_mode(1)
        try: return fn(*a, **k)
        finally: torch.cuda.set_sync_debug_mode(0)
    return run
tr.backward_all, tr.update = wrap(back), wrap(upd)
with warnings.catch_warnings():
    warnings.simplefilter("always"); warnings.showwarning = hook
    tr.step(2)
for st, n in seen.most_common(12):
    print(f"==== {n} x  {first[st]}\n{st}")
print(f"{sum(seen.values())} synchronizing calls found in one training half (2 micro-batches) at {len(seen)} places")
