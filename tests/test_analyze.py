"`opsd analyze`: step-0 instruments under three teacher prompts, the privilege audit, the token view; real models."
import argparse
import dataclasses
import json
import math
import re

import numpy as np
import polars as pl
import pytest
import torch

from opsd.analyze import (analyze, teacher_prompts, token_view_data, token_view_html, cmd_analyze, add_analyze_args,
                          privilege_audit)
from opsd.collate import collate, batch_logits
from opsd.data import teacher_prompt, student_prompt_ids
from opsd.diagnostics import loss_and_diagnostics, summarize_diagnostics
from opsd.toy import TOY_PROMPT

KEYS = ("kl/true", "entry/loss", "entry/neg_loss_frac", "entry/argmax_clipped_frac", "entry/clipped_teacher_mass",
        "entry/clipped_student_mass", "entry/clipped_entry_frac", "entry/grad_cos")


@pytest.fixture(scope="module")
def sharp(tiny_ckpt):
    "The tiny real Qwen3 with its final norm scaled x10: sharp enough next-token distributions for the clip to bite."
    from opsd.train import load_model
    model, tok = load_model(str(tiny_ckpt), "float32")
    with torch.no_grad(): model.model.norm.weight.mul_(10.0)
    return model.eval(), tok


@pytest.fixture(scope="module")
def result(sharp, toy_problems):
    return analyze(sharp, toy_problems, TOY_PROMPT, n=6, max_new_tokens=16, micro_batch=4, seed=3)


def test_the_three_prompts_really_differ(sharp, toy_problems):
    "Break: no_reference_template returning the template unchanged (the reference stays) -> fails."
    _, tok = sharp
    ps = toy_problems[:4]
    tp = teacher_prompts(tok, ps, TOY_PROMPT)
    for i, p in enumerate(ps):
        other = ps[(i + 1) % 4]["solution"]
        assert p["solution"] in tp["released"][i]
        assert p["solution"] not in tp["no_reference"][i] and TOY_PROMPT.begin not in tp["no_reference"][i]
        assert TOY_PROMPT.guard not in tp["no_reference"][i] and p["problem"] in tp["no_reference"][i]
        assert other in tp["wrong_reference"][i] and p["solution"] not in tp["wrong_reference"][i]
    # the no-reference prompt is the teacher's (its chat flags), not the student's prompt
    assert tp["no_reference"][0] == teacher_prompt(tok, ps[0]["problem"], "", dataclasses.replace(
        TOY_PROMPT, teacher_template="Problem: {problem}\n{instruction}"))


def test_numbers_equal_diagnostics_on_hand_built_batches(sharp, result):
    """Every teacher prompt's means equal `loss_and_diagnostics` on one hand-built batch of all rows (prompts built
    here, not taken from the result). Break: the teacher scored with the student prompt in `analyze` -> fails."""
    model, tok = sharp
    ps, comps = result["problems"], result["completions"]
    noref = dataclasses.replace(TOY_PROMPT, teacher_template="Problem: {problem}\n{instruction}")
    hand = dict(released=[teacher_prompt(tok, p["problem"], p["solution"], TOY_PROMPT) for p in ps],
                no_reference=[teacher_prompt(tok, p["problem"], "", noref) for p in ps],
                wrong_reference=[teacher_prompt(tok, p["problem"], ps[(i + 1) % len(ps)]["solution"], TOY_PROMPT)
                                 for i, p in enumerate(ps)])
    sp = [student_prompt_ids(tok, p["problem"], TOY_PROMPT) for p in ps]
    summary = {r["teacher"]: r for r in result["summary"].iter_rows(named=True)}
    kl = {}
    for name, texts in hand.items():
        b = collate(sp, [tok(t, add_special_tokens=False)["input_ids"] for t in texts], comps, pad_id=tok.pad_token_id,
                    eos_id=tok.eos_token_id, mode="aligned")
        with torch.no_grad():
            _, d = loss_and_diagnostics(batch_logits(model, b, "student"), batch_logits(model, b, "teacher"), b.labels,
                                        temperature=1.1, tau=0.05)
        ref = summarize_diagnostics(d)
        assert summary[name]["positions"] == b.num_items
        for k in KEYS:
            assert summary[name][k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), (name, k)
        kl[name] = ref["kl/true"]
        # the band table: rank the positions' true KL by hand (numpy); top 10% = ranks r with (r + 0.5) / n >= 0.9
        v = d["kl/true"][d["mask"]].double().numpy()
        mass = d["entry/clipped_teacher_mass"][d["mask"]].double().numpy()
        order = np.argsort(v, kind="stable")
        n = len(v)
        n_top = n - math.ceil(0.9 * n - 0.5)
        band = result["bands"].filter((pl.col("teacher") == name) & (pl.col("band") == "top 10%"))
        assert band["positions"][0] == n_top
        assert band["clipped_teacher_mass"][0] == pytest.approx(mass[order[-n_top:]].mean(), rel=1e-4, abs=1e-7)
    assert summary["released"]["entry/argmax_clipped_frac"] > 0   # the clip bites here: not vacuous
    audit = result["audit"]
    assert audit["parts"]["privilege"] == pytest.approx(kl["released"] - kl["wrong_reference"], rel=1e-4, abs=1e-7)
    assert audit["parts"]["prompt_change"] == pytest.approx(kl["no_reference"], rel=1e-4)
    if audit["shares"]: assert sum(audit["shares"].values()) == pytest.approx(1.0)
    else: assert min(audit["parts"].values()) < 0 and "no shares" in audit["note"]


def test_token_view_of_the_result(result):
    "One span per completion token, in order, carrying the batch's KL. Break: spans drawn in reverse order -> fails."
    v = result["view"]
    row = result["positions"].filter((pl.col("teacher") == "released") & (pl.col("row") == v["row"])).sort("pos")
    html = token_view_html(v)
    spans = re.findall(r'<span class="tok[^"]*" tabindex="0" data-pos="(\d+)" data-kl="([^"]+)"', html)
    assert len(spans) == len(v["tokens"]) == row.height == len(result["completions"][v["row"]])
    assert [int(p) for p, _ in spans] == list(range(row.height))
    assert [float(k) for _, k in spans] == pytest.approx(row["kl/true"].to_list(), rel=1e-4, abs=1e-7)
    assert "<script" not in html and "http" not in html
    # the default row is the completion with the largest summed KL
    sums = result["positions"].filter(pl.col("teacher") == "released").group_by("row").agg(pl.col("kl/true").sum())
    assert v["row"] == sums.sort("kl/true", descending=True)["row"][0]


def test_token_view_lists_the_clipped_entries(sharp):
    """Hand-made logits: at position 0 the teacher puts most mass on token 7, the student almost none, so that entry's
    summand t(log t - log s) exceeds tau and the card must name it; position 1 agrees exactly (KL 0, nothing clipped).
    Break: the clipped set taken as e < tau (the kept set) -> fails."""
    _, tok = sharp
    V = len(tok)
    s, t = torch.zeros(2, V), torch.zeros(2, V)
    t[0, 7], s[0, 7] = 8.0, -4.0
    t[1, 9] = s[1, 9] = 5.0
    v = token_view_data(tok, dict(problem="2+2", answer="4"), [7, 9], s, t, temperature=1.0, tau=0.05)
    p0, p1 = v["tokens"]
    name = tok.decode([7])
    assert p0["argmax_clipped"] and p0["n_clipped"] >= 1 and p0["clipped"][0][0] == name
    tv, sv = t[0].double().softmax(-1)[7].item(), s[0].double().softmax(-1)[7].item()   # by hand, float64
    assert p0["clipped"][0][1:] == pytest.approx([tv, sv, tv * (math.log(tv) - math.log(sv))], abs=1e-4)
    assert p0["teacher_top"][0][0] == name and p0["kl"] > p1["kl"] == pytest.approx(0.0, abs=1e-6)
    assert p1["n_clipped"] == 0 and not p1["argmax_clipped"]
    html = token_view_html(v)
    assert html.count('class="tok') == 2 and 'class="tok am"' in html and "clipped: 0 entries" in html


def test_cmd_analyze_writes_files_the_report_embeds(tiny_ckpt, toy_data_file, tmp_path, capsys):
    "The command on a model folder with --data: table, analysis.json, token_view.html, and a report that embeds it."
    p = add_analyze_args(argparse.ArgumentParser())
    a = p.parse_args(["--model", str(tiny_ckpt), "--data", str(toy_data_file), "--n", "3", "--max-new-tokens", "8",
                      "--out", str(tmp_path / "an")])
    res = cmd_analyze(a)
    out = capsys.readouterr().out
    for name in ("released", "no_reference", "wrong_reference", "privilege audit"):
        assert name in out
    js = json.loads((tmp_path / "an" / "analysis.json").read_text())
    assert [r["teacher"] for r in js["summary"]] == ["released", "no_reference", "wrong_reference"]
    assert js["summary"][0]["kl/true"] == pytest.approx(res["summary"]["kl/true"][0])
    from opsd.report import write_report
    page = write_report([tmp_path / "an"], tmp_path / "report", png=False).read_text()
    assert 'id="token-view"' in page and page.count('class="tok') == len(res["view"]["tokens"])
    with pytest.raises(ValueError, match="--n must be >= 1"):
        cmd_analyze(argparse.Namespace(**{**vars(a), "n": 0}))


def test_privilege_audit_by_hand():
    "The audit's parts from three KL values (released 0.1, wrong 0.04, none 0.01)."
    a = privilege_audit(pl.DataFrame(dict(teacher=["released", "no_reference", "wrong_reference"],
                                          **{"kl/true": [0.1, 0.01, 0.04]})))
    assert a["parts"] == pytest.approx(dict(prompt_change=0.01, reference_text=0.03, privilege=0.06))
    assert a["shares"]["privilege"] == pytest.approx(0.6) and a["note"] is None
    # parts of both signs (the toy: released 0.001, none 0.0114, wrong 0.0156): no shares such as 1139%, a note
    a = privilege_audit(pl.DataFrame(dict(teacher=["released", "no_reference", "wrong_reference"],
                                          **{"kl/true": [0.001, 0.0114, 0.0156]})))
    assert a["parts"]["privilege"] == pytest.approx(-0.0146) and a["shares"] == {}
    assert "privilege is negative" in a["note"]


def test_one_problem_is_analysed_without_the_wrong_reference(sharp, toy_problems, capsys):
    """n=1 on one problem: the released and no-reference prompts are scored, wrong_reference is left out with a note
    (it used to refuse: 'wrong_reference: no other problem ...'). Break tried: audit_teachers keeping wrong_reference."""
    res = analyze(sharp, toy_problems[:1], TOY_PROMPT, n=1, max_new_tokens=4)
    assert res["summary"]["teacher"].to_list() == ["released", "no_reference"]
    assert res["config"]["teachers"] == ["released", "no_reference"] and "parts" not in res["audit"]
    assert any("wrong_reference skipped" in n for n in res["notes"])
    from opsd.analyze import format_analysis
    assert "wrong_reference skipped" in format_analysis(res)


def test_smollm2_slice(tmp_path, capsys):
    "The real SmolLM2-135M-Instruct (converted once, cached), n=2, 16 new tokens: the three prompts and finite numbers."
    from opsd import smollm2  # installed by `bash dev.sh setup`: a missing package fails here, it is not skipped
    smollm2.smollm2_base()
    a = add_analyze_args(argparse.ArgumentParser()).parse_args(
        ["--model", "smollm2", "--n", "2", "--max-new-tokens", "16", "--threads", "1", "--out", str(tmp_path)])
    res = cmd_analyze(a)
    s = {r["teacher"]: r for r in res["summary"].iter_rows(named=True)}
    assert set(s) == {"released", "no_reference", "wrong_reference"}
    for r in s.values():
        assert r["positions"] > 0 and all(math.isfinite(r[k]) for k in KEYS) and r["kl/true"] >= 0
    p0 = res["problems"][0]
    assert s["released"]["prompt_tokens"] > s["no_reference"]["prompt_tokens"]
    assert res["prompts"]["released"][0] != res["prompts"]["wrong_reference"][0]
    assert (tmp_path / "token_view.html").read_text().count('class="tok') == len(res["view"]["tokens"]) > 0
    assert p0["solution"] and s["released"]["kl/true"] > 0


def test_one_completion_takes_its_wrong_reference_from_the_next_problem(sharp, toy_problems):
    "n=1 with two problems given: the wrong reference is problem 1's solution. Break: the pool cut to n rows -> fails."
    _, tok = sharp
    res = analyze(sharp, toy_problems[:2], TOY_PROMPT, n=1, max_new_tokens=4)
    wrong = tok.decode(res["prompts"]["wrong_reference"][0])
    assert toy_problems[1]["solution"] in wrong and toy_problems[0]["solution"] not in wrong
    assert len(res["completions"]) == 1 and res["summary"].height == 3
