"""The SmolLM2 world's calibration on one GPU: base student and teacher (shown the reference) accuracy on
the fixed held-out word problems, per difficulty level, greedy and avg@8 at the evaluation sampling, through one vLLM
engine and `opsd.eval.evaluate` (the one grader, math mode). One JSON line per row. Usage: python3 THIS [n]"""
import json, sys, time

import polars as pl
from transformers import AutoTokenizer

from opsd.data import student_prompt, teacher_prompt
from opsd.eval import default_eval_sampling, evaluate
from opsd.rollout import SamplingConfig, VLLMRollout
from opsd.smollm2 import SMOLLM2_EVAL, SMOLLM2_PROMPT, smollm2_base, word_problems

n = int(sys.argv[1]) if len(sys.argv) > 1 else SMOLLM2_EVAL["n"]
path = smollm2_base()
tok = AutoTokenizer.from_pretrained(path)
ro = VLLMRollout(str(path), tok, gpu_memory_utilization=0.3, max_model_len=1024, seed=0, progress=False)
budget = SMOLLM2_EVAL["max_new_tokens"]
who = {"student": lambda t, p: student_prompt(t, p["problem"], SMOLLM2_PROMPT),
       "teacher": lambda t, p: teacher_prompt(t, p["problem"], p["solution"], SMOLLM2_PROMPT)}
for level in (1, 2, 3):
    probs = word_problems(n, seed=SMOLLM2_EVAL["seed"], split="test", difficulty=level)
    for w, fn in who.items():
        for k, sampling in ((1, SamplingConfig(temperature=0, max_new_tokens=budget)),
                            (8, default_eval_sampling(0, max_new_tokens=budget))):
            t0 = time.perf_counter()
            df = evaluate(None, tok, probs, k=k, sampling=sampling, prompt_fn=fn, grade_mode="math", backend=ro)
            acc = df.group_by("problem_id").agg(pl.col("correct").cast(pl.Float64).mean())["correct"].mean()
            print(json.dumps(dict(level=level, who=w, k=k, greedy=k == 1, n=n, acc=round(acc, 4),
                                  boxed=round(df["pred"].is_not_null().mean(), 3),
                                  mean_len=round(df["completion_len"].mean(), 1),
                                  stop=round((df["finish_reason"] == "stop").mean(), 3),
                                  seconds=round(time.perf_counter() - t0, 1))), flush=True)
