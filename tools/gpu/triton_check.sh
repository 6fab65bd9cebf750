#!/usr/bin/env bash
# The Triton fused loss (opsd.fused_triton, nbs/02b_fused_triton) on one H200: tests on CUDA, the tests under Triton's
# interpreter (the bundled triton's), the kernel alone at a few tile shapes, then the loss benchmark side by side.
# Run from the repo root after `bash tools/gpu/install.sh opsd` (opsd's deps in /tmp/site); logs land in $OUT.
# About 3-4 minutes: pytest ~1 min (compiles), sweep ~20 s, bench ~1.5 min (torch.compile of `fused` included).
set -o pipefail
source tools/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site ] || echo "warning: /tmp/site is missing (run tools/gpu/install.sh opsd first if imports fail)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/triton_env.log"

t0=$(date +%s)
echo "== pytest on CUDA (compiled kernel)"
python3 -m pytest -q tests/test_fused_triton.py -p no:cacheprovider -rs 2>&1 | tee "$OUT/triton_pytest_cuda.log" | tail -15
echo "pytest cuda wall $(( $(date +%s) - t0 )) s"

if [ -n "${INTERP:-}" ]; then  # optional (INTERP=1): the interpreter run costs minutes of device time
t0=$(date +%s)
echo "== pytest under Triton's interpreter (CPU tensors, this triton version)"
CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 240 python3 -m pytest -q tests/test_fused_triton.py -p no:cacheprovider -x 2>&1 \
  | tee "$OUT/triton_pytest_interp.log" | tail -5
echo "pytest interpreter wall $(( $(date +%s) - t0 )) s"

fi

echo "== the kernel alone: one default-size chunk (256 rows x 151,936), entry clip, every diagnostic, bf16 gradient"
python3 - <<'EOF' 2>&1 | tee "$OUT/triton_sweep.log"
import json, os, time, torch
from opsd.fused_triton import chunk_divergence_triton
from opsd.diagnostics import loss_grad_diagnostics
C, V = 256, 151936
zs = torch.randn(C, V, device="cuda") * 4; zt = zs + torch.randn(C, V, device="cuda")
g = torch.empty(C, V, device="cuda", dtype=torch.bfloat16)
rper, rg, rd = loss_grad_diagnostics(zs[:32], zt[:32], temperature=1.1, tau=0.05)
best = None
for block, warps in ((1024, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
    f = lambda: chunk_divergence_triton(zs, zt, temperature=1.1, tau=0.05, grad_dtype=torch.bfloat16, grad_out=g, block=block, num_warps=warps)
    try:
        per, _, d = f(); torch.cuda.synchronize()
    except Exception as e:
        print(f"BLOCK={block} warps={warps}: failed {type(e).__name__}: {str(e)[:200]}"); continue
    err = max(float((d[k][:32].double() - rd[k].double()).abs().max()) for k in rd if rd[k].dtype != torch.bool)
    gerr = float((g[:32].double() - rg.double()).norm() / rg.double().norm())
    ts = []
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(10): f()
        torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) / 10 * 1e3)
    ms = min(ts)
    print(f"BLOCK={block:5d} warps={warps:2d}: {ms:.3f} ms/chunk, {C * V * 26 / ms / 1e6:6.0f} GB/s (26 B/entry), "
          f"max diag err {err:.1e}, bf16 grad err {gerr:.1e}")
    if best is None or ms < best[0]: best = (ms, block, warps)
print("best", best, f"-> x{8192 // C} chunks at N=8192: {best[0] * 8192 / C:.1f} ms of kernel")
open("/tmp/triton_best.env", "w").write(f"export OPSD_TRITON_BLOCK={best[1]} OPSD_TRITON_WARPS={best[2]}\n")
EOF

t0=$(date +%s)
echo "== python -m opsd.bench loss (default tile 2048/8)"
python3 -m opsd.bench loss --sizes 2048,8192 --variants naive_bf16,fused,fused_triton --out "$OUT/loss_triton.json" 2>&1 \
  | tee "$OUT/loss_triton.md" | grep -v Warning
echo "bench wall $(( $(date +%s) - t0 )) s"
if [ -f /tmp/triton_best.env ] && ! grep -q "BLOCK=2048 OPSD_TRITON_WARPS=8" /tmp/triton_best.env; then
  source /tmp/triton_best.env; echo "== fused_triton again at the sweep's best tile: $(cat /tmp/triton_best.env)"
  python3 -m opsd.bench loss --sizes 8192 --variants naive_bf16,fused_triton --out "$OUT/loss_triton_best.json" 2>&1 \
    | tee "$OUT/loss_triton_best.md" | grep -v Warning
fi
