#!/usr/bin/env bash
# Build the 1.7B-shaped checkpoint + run folder (once), then time `opsd eval` at 30 problems x 12 samples x 1024 tokens.
source tools/gpu/env.sh
[ -f /tmp/w/runs/rand17/config.json ] || python3 tools/gpu/make_ckpt.py /tmp/w 2>&1 | grep -v Warning | tail -4
t0=$(date +%s.%N)
echo "+ python3 -m opsd.cli eval /tmp/w/runs/rand17 --data /tmp/w/problems.jsonl --n 30 --k 12 --max-new-tokens 1024"
python3 -m opsd.cli eval /tmp/w/runs/rand17 --data /tmp/w/problems.jsonl --n 30 --k 12 --max-new-tokens 1024 > $OUT/eval.log 2>&1
echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
grep -E "opsd eval|ready in|Traceback|Error|error|avg_at_k|step|──|│|eval_runs|Asynchronous|KV cache|Maximum concurrency|init engine|CUDA graph" $OUT/eval.log | grep -v "it/s\]" | tail -40
