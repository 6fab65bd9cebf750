"""`teacher_context`: the trainer's teacher reads its own reference, none, or another problem's, through the one
definition that `opsd analyze` audits (`opsd.data.teacher_context_prompt`)."""
import json

import polars as pl
import pytest

from conftest import opsd_main
from opsd.data import TEACHER_CONTEXTS, prompt_ids, teacher_context_prompt, teacher_prompt, other_reference
from opsd.train import OPSDConfig, OPSDTrainer


def test_trainer_teacher_prompts_are_the_contexts(tiny_ckpt, toy_problems, tmp_path):
    """The ids the trainer's teacher scores are each context's prompt, rebuilt here from the problem records.
    Break that made it fail: `OPSDTrainer.prompts` building the teacher from the row's own solution whatever the
    context (every context then trains the released teacher)."""
    probs = toy_problems[:6]
    seen = {}
    for ctx in TEACHER_CONTEXTS:
        tr = OPSDTrainer(OPSDConfig.toy(model=str(tiny_ckpt), run_dir=str(tmp_path / ctx), teacher_context=ctx,
                                        steps=1, batch_size=2, micro_batch_size=2), probs, progress=False)
        seen[ctx] = [tr.tok.decode(tr.prompts(i)[1]) for i in range(len(probs))]
        assert [tr.prompts(i)[1] for i in range(len(probs))] == \
            [prompt_ids(tr.tok, teacher_context_prompt(tr.tok, probs, i, ctx, tr.prompt_cfg)) for i in range(len(probs))]
    for i, p in enumerate(probs):   # the texts themselves, built another way (the released teacher_prompt)
        assert seen["reference"][i] == teacher_prompt(tr.tok, p["problem"], p["solution"], tr.prompt_cfg)
        other = probs[other_reference(probs, i)]
        assert seen["wrong"][i] == teacher_prompt(tr.tok, p["problem"], other["solution"], tr.prompt_cfg)
        assert other["answer"] != p["answer"] and p["solution"] not in seen["none"][i] and p["problem"] in seen["none"][i]


def test_wrong_needs_two_answers(tiny_ckpt, tmp_path):
    "One distinct answer in the data: `teacher_context=wrong` is refused in one line naming the data, before training."
    data = tmp_path / "same.jsonl"
    data.write_text("".join(json.dumps(dict(problem=f"{a}+0?", solution=f"{a}+0=2 \\boxed{{2}}", answer="2")) + "\n"
                            for a in (2, 2)))
    code, out, err = opsd_main("train", "--model", str(tiny_ckpt), "--data", str(data), "--run-dir",
                               str(tmp_path / "run"), "--set", "teacher_context=wrong", "--quiet")
    assert code != 0 and err.strip().count("\n") == 0, err
    assert "same.jsonl" in err and "no problem with an answer different from row 0" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("ctx", ["none"])
def test_cli_train_on_the_toy(ctx, tiny_ckpt, toy_data_file, tmp_path):
    """`opsd train --set teacher_context=none` on the toy model runs a step; the config records the context and the
    step-1 KL (scored before any update, on the same seed's completions) differs from the released teacher's."""
    kl = {}
    for c in ("reference", ctx):
        rd = tmp_path / c
        code, out, err = opsd_main("train", "--model", str(tiny_ckpt), "--data", str(toy_data_file), "--run-dir",
                                   str(rd), "--steps", "1", "--batch-size", "2", "--micro-batch-size", "2",
                                   "--set", f"teacher_context={c}", "sampling.max_tokens=8", "--quiet")
        assert code == 0, err[-2000:]
        assert json.loads((rd / "config.json").read_text())["teacher_context"] == c
        kl[c] = pl.read_ndjson(rd / "metrics.jsonl")["kl/true"][0]
    assert kl[ctx] > 0 and kl[ctx] != kl["reference"], kl
