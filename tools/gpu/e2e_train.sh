#!/usr/bin/env bash
# The trainer on one GPU machine: `python -m opsd.bench e2e` (the recipes), then `opsd train --recipe ${RECIPE:-released}` (3 steps).
source tools/gpu/env.sh
[ -f /tmp/w/runs/rand17/config.json ] || python3 tools/gpu/make_ckpt.py /tmp/w 2>&1 | grep -v Warning | tail -4
what=${1:-both}
if [ "$what" != train ]; then
  echo "+ python3 -m opsd.bench e2e --model /tmp/w/qwen3-1.7b-random --steps ${STEPS:-4} --warmup 1 ${VARIANTS:+--variants $VARIANTS}"
  t0=$(date +%s)
  python3 -m opsd.bench e2e --model /tmp/w/qwen3-1.7b-random --steps ${STEPS:-4} --warmup 1 ${VARIANTS:+--variants "$VARIANTS"} --out $OUT/e2e.json > $OUT/e2e.log 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E '^\{"variant|^\||Traceback|Error|error' $OUT/e2e.log | tail -30
fi
if [ "$what" != e2e ]; then
  echo "+ python3 -m opsd.cli train --model /tmp/w/qwen3-1.7b-random --data /tmp/w/problems.jsonl --run-dir /tmp/w/runs/train-default --steps 3 --recipe ${RECIPE:-released}"
  t0=$(date +%s)
  python3 -m opsd.cli train --model /tmp/w/qwen3-1.7b-random --data /tmp/w/problems.jsonl --run-dir /tmp/w/runs/train-default --steps 3 --recipe ${RECIPE:-released} > $OUT/train.log 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E "Traceback|Error|rollout|VLLM|vllm|ready" $OUT/train.log | grep -v "it/s\]" | tail -8
  python3 - <<'PY'
from opsd.runs import read_metrics, read_config
m = read_metrics("/tmp/w/runs/train-default"); c = read_config("/tmp/w/runs/train-default")
print("rollout:", c.get("rollout"), "->", [k for k in c if "vllm" in k])
cols = [k for k in ("step", "time/rollout", "time/train", "time/sync", "seconds", "tokens", "completion_len", "loss", "kl/true") if k in m.columns]
print(m.select(cols))
PY
fi
