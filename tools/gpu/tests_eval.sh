#!/usr/bin/env bash
source tools/gpu/env.sh
cat /tmp/w/ckpt.log | grep -v Warn | tail -3
for i in $(seq 60); do [ -d /tmp/w/runs/rand17/checkpoints/step-10 ] && break; sleep 2; done
nvidia-smi --query-gpu=name,memory.used --format=csv
t0=$(date +%s)
python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider 2>&1 | tee $OUT/test_gpu.log | grep -E "passed|failed|error|Error" | tail -5
echo "test_gpu wall $(( $(date +%s) - t0 )) s"
bash tools/gpu/eval_time.sh
