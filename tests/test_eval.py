"""Tests of opsd.eval: answer extraction, grading, avg@k / pass@k / majority, seed summaries,
evaluate with a real tiny model, and checkpoint sweeps."""
import json
import math
import threading
from itertools import combinations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.data import last_boxed
from opsd.eval import (answer_correct, avg_at_k, grade, majority_vote, normalize_answer, pass_at_k, seed_summary,
                       seed_table, summarize_eval)


# ---------------------------------------------------------------- extraction
@pytest.mark.parametrize("text,expected", [
    (r"The answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{\left(2+\frac{1}{x}\right)}}", r"\frac{\sqrt{3}}{\left(2+\frac{1}{x}\right)}"),
    (r"a \boxed{1} b \boxed{2} c \boxed{3}", "3"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count for nesting
    (r"\fbox{x=3}", "x=3"),
    (r"\boxed{1} then \fbox{2}", "2"),
    (r"\boxed {  7 }", "7"),
    (r"\boxed 5", "5"),
    (r"$\boxed{10}$ and more text", "10"),
    (r"\boxed{}", ""),
    ("no box at all", None),
    ("", None),
    (None, None),
    (r"\boxed{1} and \boxed{2", None),  # the last box is cut off: no answer
    (r"\boxedx{3}", None),  # not the \boxed command
])
def test_last_boxed(text, expected):
    # the one extractor (opsd.data.last_boxed), as the grader uses it
    assert last_boxed(text) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="0123456789+-x^ ", min_size=1, max_size=6), min_size=1, max_size=4))
def test_last_boxed_last_of_many(answers):
    # property: for any answers without braces, the last box's stripped content comes back
    text = " and ".join(r"\boxed{" + a + "}" for a in answers)
    assert last_boxed(text) == answers[-1].strip()


# ---------------------------------------------------------------- grading
@pytest.mark.parametrize("pred,gold", [
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"\frac{1}{2}"),
    ("2", "2.0"),
    ("2.0", "2"),
    (r"\dfrac{3}{4}", r"\frac{3}{4}"),
    ("x+1", "1+x"),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    ("1,000", "1000"),
    (r"$12$", "12"),
    (r"\text{(B)}", "(B)"),
])
def test_grade_math_equivalent(pred, gold):
    assert answer_correct(pred, gold, mode="math") is True
    assert grade(rf"so the answer is \boxed{{{pred}}}.", gold, mode="math") is True


@pytest.mark.parametrize("pred,gold", [("3", "4"), (r"\frac{1}{3}", "0.5"), ("x+2", "x+1"), ("", "1"), (None, "1")])
def test_grade_math_different(pred, gold):
    assert answer_correct(pred, gold, mode="math") is False


def test_grade_exact_mode():
    assert answer_correct("42", "42", mode="exact")
    assert answer_correct(" 42. ", 42, mode="exact")  # normalised
    assert answer_correct("2.0", "2", mode="exact")  # numbers are canonical
    assert not answer_correct(r"\frac{1}{2}", "0.5", mode="exact")  # no maths in exact mode
    assert not answer_correct("41", "42", mode="exact")
    assert not answer_correct(None, "42", mode="exact")
    with pytest.raises(ValueError, match="mode"):
        grade(r"\boxed{1}", "1", mode="sympy")


def test_grade_completion():
    # the one grader: the last box of the completion against the answer (\boxed{07} vs "7", \boxed 7)
    assert grade(r"so \boxed{07}.", "7", "exact") and grade(r"\boxed 7", "7", "exact")
    assert grade(r"first \boxed{3}, then \boxed{7}", "7", "exact")
    assert not grade(r"\boxed{7} but cut off \boxed{8", "7", "exact")  # the last box is unclosed: no answer
    assert not grade("7", "7", "exact")  # no box, no answer
    assert not grade(None, "7") and not grade("", "7")
    assert grade(r"\boxed{\dfrac{1}{2}}", "0.5") and not grade(r"\boxed{\dfrac{1}{2}}", "0.5", "exact")


def test_grade_unparseable_falls_back_to_strings():
    weird = r"\weirdcommand{\foo}"
    assert answer_correct(weird, weird, mode="math")  # equal strings are correct even if math-verify cannot parse them
    assert not answer_correct(weird, r"\other{\bar}", mode="math")


def test_grade_off_main_thread():
    # math-verify's signal-based timeout would raise ValueError in a worker thread
    out = {}
    t = threading.Thread(target=lambda: out.update(a=grade(r"\boxed{\frac{1}{2}}", "0.5"), b=grade(r"\boxed{3}", "4")))
    t.start(), t.join()
    assert out == dict(a=True, b=False)


def test_normalize_answer():
    assert normalize_answer(r" $\left(1, 2\right)$ ") == "(1,2)"
    assert normalize_answer("-0.0") == "0"
    assert normalize_answer("007") == "7"
    assert normalize_answer(r"90^\circ") == "90"
    assert normalize_answer(None) is None


# ---------------------------------------------------------------- avg@k, pass@k, majority
def _brute_pass_at_k(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_finite():
    # the product form avoids huge binomials: n=200 is fine and pass@1 = c/n
    assert pass_at_k(200, 37, 1) == pytest.approx(37 / 200)
    assert 0 < pass_at_k(200, 3, 50) < 1


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_bad_input(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_k():
    assert avg_at_k([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]) == pytest.approx(0.5)
    assert avg_at_k(np.array([[True, False], [True, True]])) == pytest.approx(0.75)
    assert avg_at_k([[1], [0, 0, 0, 1]]) == pytest.approx((1 + 0.25) / 2)  # per-problem mean first
    with pytest.raises(ValueError, match="no problems"):
        avg_at_k([])


def test_majority_vote():
    assert majority_vote(["1", "2", "2"]) == "2"
    assert majority_vote(["1", "2", "2", "1"]) == "1"  # tie: first seen
    assert majority_vote(["2", "1", "1", "2"]) == "2"
    assert majority_vote([None, "5", None]) == "5"  # None is not an answer
    assert majority_vote(["0.5", "1/2", "0.50"]) == "0.5"  # normalised keys: "0.5" twice
    assert majority_vote([None]) is None
    assert majority_vote([]) is None


def test_seed_summary_numbers():
    s = seed_summary([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == pytest.approx(2.5)
    assert s["sd"] == pytest.approx(math.sqrt(5 / 3))  # sum of squares 5, ddof=1
    assert s["se"] == pytest.approx(math.sqrt(5 / 3) / 2)
    assert s["n"] == 4
    # the 4-seed cosine result in the spec: sd 1.33 -> se 0.665
    spread = [55.21 + d for d in (-1.33, 1.33, -1.33, 1.33)]
    assert seed_summary(spread)["se"] == pytest.approx(1.33 * 2 / math.sqrt(3) / 2)
    one = seed_summary([7.0])
    assert one["mean"] == 7.0 and one["n"] == 1 and math.isnan(one["sd"]) and math.isnan(one["se"])
    with pytest.raises(ValueError, match="no values"):
        seed_summary([])
    with pytest.raises(ValueError, match="value 2"):
        seed_summary([1.0, 2.0, float("inf")])


# ---------------------------------------------------------------- summaries
def _rows():
    # run r, two seeds, 3 problems x 4 samples; correctness chosen by hand
    corr = {0: [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], 1: [[1, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 0]]}
    rows = []
    for seed, mat in corr.items():
        for p, samples in enumerate(mat):
            for j, c in enumerate(samples):
                rows.append(dict(run="r", step=10, seed=seed, split="test", problem_id=str(p), sample=j,
                                 correct=bool(c), pred="ok" if c else f"bad{j % 2}", answer="ok"))
    return pl.DataFrame(rows), corr


def test_summarize_eval_against_hand_numbers():
    frame, corr = _rows()
    s = summarize_eval(frame, ks=[1, 2, 4]).sort("seed")
    assert s["k"].to_list() == [4, 4] and s["n_problems"].to_list() == [3, 3]
    for i, seed in enumerate([0, 1]):
        mat = corr[seed]
        assert s["avg_at_k"][i] == pytest.approx(avg_at_k(mat))
        assert s["pass@1"][i] == pytest.approx(avg_at_k(mat))
        for j in (2, 4):
            expect = np.mean([_brute_pass_at_k(4, sum(r), j) for r in mat])
            assert s[f"pass@{j}"][i] == pytest.approx(expect)
        assert s["pass_at_k"][i] == pytest.approx(s["pass@4"][i])
    # majority: seed 0: p0 tie ok/bad0 -> "ok" first seen -> correct; p1 bad; p2 ok -> 2/3
    #           seed 1: p0 "ok","bad1","bad0","bad1" -> bad1 (2) wrong; p1 wrong; p2 ok -> 1/3
    assert s["maj_at_k"].to_list() == pytest.approx([2 / 3, 1 / 3])
    t = seed_table(s)
    assert t["n"][0] == 2 and t["mean"][0] == pytest.approx(s["avg_at_k"].mean())


def test_summarize_eval_bad_input():
    frame, _ = _rows()
    with pytest.raises(ValueError, match="correct"):
        summarize_eval(frame.drop("correct"))
    with pytest.raises(ValueError, match="nope"):
        summarize_eval(frame, by=["nope"])
    with pytest.raises(ValueError, match="pass@5"):
        summarize_eval(frame, ks=[5])


# ---------------------------------------------------------------- evaluate and sweeps with a real tiny model
import copy

import torch

from opsd.eval import EVAL_COLUMNS, eval_runs, evaluate, sweep_checkpoints


@pytest.fixture(scope="module")
def tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opsd.toy import toy_tokenizer

    tok = toy_tokenizer()  # the evaluation's claims hold for any tokenizer; a 363-entry vocabulary keeps it quick
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True,
                      initializer_range=0.5)  # a wide init: varied (non-degenerate) completions
    return Qwen3ForCausalLM(cfg).eval(), tok


PROBLEMS = [dict(problem=f"What is {a} + {b}?", answer=str(a + b)) for a, b in [(1, 2), (3, 4), (10, 5)]]
RAW = lambda text: text.strip() or None  # the whole completion is the answer (a random model never boxes)


def _greedy(max_new_tokens=6):
    from opsd.rollout import SamplingConfig

    return SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)


def test_evaluate_rows_and_grading(tiny):
    from opsd.data import student_prompt_ids
    from opsd.rollout import HFRollout

    model, tok = tiny
    # the greedy completions, decoded, are by construction the right "answers" under extract_fn=RAW
    prompts = [student_prompt_ids(tok, p["problem"]) for p in PROBLEMS]
    ro = HFRollout(model, tok, progress=False).generate(prompts, _greedy())
    texts = [tok.decode(c, skip_special_tokens=True).strip() for c in ro.completion_ids]
    probs = [dict(p, answer=t, id=f"q{i}") for i, (p, t) in enumerate(zip(PROBLEMS, texts))]
    probs[2]["answer"] = "not what it says"
    fr = evaluate(model, tok, probs, k=2, sampling=_greedy(), extract_fn=RAW, batch_size=4)
    assert fr.columns == EVAL_COLUMNS and fr.height == 6
    assert fr["problem_id"].to_list() == ["q0", "q0", "q1", "q1", "q2", "q2"]
    assert fr["sample"].to_list() == [0, 1] * 3
    assert fr["correct"].to_list() == [True, True, True, True, False, False]
    assert fr["completion_len"].to_list() == [len(c) for c in ro.completion_ids for _ in range(2)]
    assert set(fr["finish_reason"].to_list()) <= {"stop", "length"}
    # default extraction: no \boxed{} in these completions -> pred None -> wrong
    fr2 = evaluate(model, tok, PROBLEMS, k=1, sampling=_greedy())
    assert fr2["pred"].to_list() == [None] * 3 and not any(fr2["correct"])
    assert fr2["problem_id"].to_list() == ["0", "1", "2"]


def test_evaluate_seeds(tiny):
    from opsd.rollout import SamplingConfig

    model, tok = tiny
    s = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5)
    a = evaluate(model, tok, PROBLEMS, k=2, sampling=s, seed=3, extract_fn=RAW, batch_size=4)
    b = evaluate(model, tok, PROBLEMS, k=2, sampling=s, seed=3, extract_fn=RAW, batch_size=4)
    c = evaluate(model, tok, PROBLEMS, k=2, sampling=s, seed=4, extract_fn=RAW, batch_size=4)
    assert a.equals(b)
    assert a["pred"].to_list() != c["pred"].to_list()


def test_evaluate_bad_input(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="problem 1 has no 'answer'"):
        evaluate(model, tok, [PROBLEMS[0], dict(problem="x")], sampling=_greedy())
    with pytest.raises(ValueError, match="k >= 1"):
        evaluate(model, tok, PROBLEMS, k=0)


def _logits(model, tok):
    ids = torch.tensor([tok.encode("Problem: 1 + 1", add_special_tokens=False)])
    with torch.no_grad():
        return model(ids).logits


def test_sweep_checkpoints(tiny, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tok = tiny
    run = tmp_path / "runs" / "tiny-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dict(name="tiny", clip="entry")))
    for step, seed in ((2, 1), (4, 2)):
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
        get_peft_model(copy.deepcopy(model), lora).save_pretrained(run / "checkpoints" / f"step-{step}")
    ref = _logits(model, tok)
    kw = dict(sampling=_greedy(8), extract_fn=RAW, grade_mode="exact", batch_size=8)
    fr = sweep_checkpoints(run, model, tok, PROBLEMS, k=2, seeds=(0,), **kw)
    # the base model comes back unchanged, without LoRA modules
    torch.testing.assert_close(_logits(model, tok), ref, rtol=0, atol=0)
    assert not isinstance(model, PeftModel) and not any("lora" in n for n, _ in model.named_modules())
    rows = [json.loads(l) for l in (run / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 3 * 2 == fr.height
    assert {(r["run"], r["step"], r["seed"], r["split"]) for r in rows} == {("tiny", s, 0, "test") for s in (0, 2, 4)}
    assert set(rows[0]) >= {"run", "step", "seed", "split", "problem_id", "sample", "correct", "pred", "answer"}
    # step rows are what evaluating that adapter directly gives, and the adapter changes the completions
    direct = evaluate(PeftModel.from_pretrained(copy.deepcopy(model), str(run / "checkpoints" / "step-2")), tok,
                      PROBLEMS, k=2, seed=0, **kw)
    got = fr.filter(pl.col("step") == 2).select(EVAL_COLUMNS)
    assert got.equals(direct)
    assert fr.filter(pl.col("step") == 0)["pred"].to_list() != got["pred"].to_list()
    # append-safe resume: nothing is redone; a new seed only adds its rows
    assert sweep_checkpoints(run, model, tok, PROBLEMS, k=2, seeds=(0,), **kw).height == 0
    more = sweep_checkpoints(run, model, tok, PROBLEMS, k=2, seeds=(0, 1), steps=[4], include_base=False, **kw)
    assert set(more["step"].to_list()) == {4} and set(more["seed"].to_list()) == {1}
    assert len((run / "eval.jsonl").read_text().splitlines()) == 18 + 6
    s = summarize_eval(pl.read_ndjson(run / "eval.jsonl", infer_schema_length=None))
    assert s.height == 4 and set(s["k"].to_list()) == {2}
    with pytest.raises(ValueError, match=r"steps \[3\]"):
        sweep_checkpoints(run, model, tok, PROBLEMS, steps=[3], **kw)


def test_backends_on_cpu(tiny):
    # 'auto' is HF without a GPU; 'vllm' fails with the fix named; a built backend object is used as given
    from opsd.rollout import HFRollout

    model, tok = tiny
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    a = evaluate(model, tok, PROBLEMS, k=1, sampling=_greedy(), extract_fn=RAW, backend="auto")
    hf = HFRollout(model, tok, progress=False)
    b = evaluate(model, tok, PROBLEMS, k=1, sampling=_greedy(), extract_fn=RAW, backend=hf)
    assert a.equals(b)
    c = evaluate(model, tok, PROBLEMS, k=1, sampling=_greedy(20), extract_fn=RAW, max_new_tokens=3)
    assert max(c["completion_len"].to_list()) <= 3  # max_new_tokens replaces the sampling budget
    with pytest.raises(RuntimeError, match="rollout='hf'"):
        evaluate(model, tok, PROBLEMS, backend="vllm", max_new_tokens=4)


def test_eval_runs_one_backend(tiny, tmp_path, monkeypatch):
    # eval_runs (what `opsd eval` runs): base model from the run config, every run and checkpoint, summary back
    from peft import LoraConfig, get_peft_model

    from opsd.runs import RunDir, read_eval

    model, tok = tiny
    base = tmp_path / "base"
    model.save_pretrained(base), tok.save_pretrained(base)
    runs = []
    for name in ("a", "b"):
        rd = RunDir(tmp_path / name)
        rd.write_config(dict(model=str(base), dtype="float32", name=name, seed=0))
        torch.manual_seed(len(name))
        lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(copy.deepcopy(model), lora).save_pretrained(rd.checkpoints_dir / "step-3")
        runs.append(rd.path)
    s = eval_runs(runs, lambda cfg: PROBLEMS, k=2, seeds=(0, 1), backend="hf", max_new_tokens=4, grade_mode="exact",
                  extract_fn=RAW, progress=False)
    assert sorted(zip(s["run"].to_list(), s["step"].to_list(), s["seed"].to_list())) == \
        sorted((r, st, sd) for r in ("a", "b") for st in (0, 3) for sd in (0, 1))
    assert set(s["k"].to_list()) == {2} and set(s["n_problems"].to_list()) == {3}
    assert read_eval(runs[0]).height == 2 * 2 * 3 * 2  # steps x seeds x problems x k
    # the base rows (step 0) of the two runs are the same samples: one engine, same weights, same seeds
    fa, fb = (read_eval(r).filter(pl.col("step") == 0).sort("seed", "problem_id", "sample") for r in runs)
    assert fa["pred"].to_list() == fb["pred"].to_list()
    # the key: the base folder's fingerprint (opsd.repro's), each adapter's, the same setting in both runs
    ra = read_eval(runs[0])
    assert set(ra["key_base"].to_list()) == {weights_fingerprint(base)}
    assert set(ra.filter(pl.col("step") == 3)["key_weights"].to_list()) == \
        {weights_fingerprint(runs[0] / "checkpoints" / "step-3" / "adapter_model.safetensors")}
    assert set(ra["setting"].to_list()) == set(read_eval(runs[1])["setting"].to_list())
    # done runs start no engine (a vLLM engine costs about a minute): the same call again makes no backend
    # (break that made it fail: the engine made before the sweeps, as before -> 'an engine was made')
    import opsd.rollout

    def no_engine(*a, **k):
        raise AssertionError("an engine was made for runs with nothing to evaluate")
    monkeypatch.setattr(opsd.rollout, "make_rollout", no_engine)
    again = eval_runs(runs, lambda cfg: PROBLEMS, k=2, seeds=(0, 1), backend="hf", max_new_tokens=4,
                      grade_mode="exact", extract_fn=RAW, progress=False)
    assert again.equals(s)
    other = RunDir(tmp_path / "c"); other.write_config(dict(model="elsewhere"))
    with pytest.raises(ValueError, match="different base models"):
        eval_runs(runs + [other.path], PROBLEMS)


# ---------------------------------------------------------------- keyed rows, partial blocks, one writer, bad input
import hashlib
import io
import time

from opsd.eval import data_hash, scan_eval
from opsd.repro import folder_lock, weights_fingerprint
from opsd.runs import read_eval

KW = dict(extract_fn=RAW, grade_mode="exact", batch_size=8, progress=False)


def _lora(model, seed, path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(model), lora).save_pretrained(path)


@pytest.fixture
def run2(tiny, tmp_path):
    "A run folder with two non-zero LoRA checkpoints of the tiny model (steps 2 and 4)."
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dict(name="keyed")))
    for step in (2, 4):
        _lora(tiny[0], step, run / "checkpoints" / f"step-{step}")
    return run


def _sweep(run, tiny, problems=PROBLEMS, k=2, budget=6, **kw):
    model, tok = tiny
    return sweep_checkpoints(run, model, tok, problems, k=k, sampling=_greedy(budget), **{**KW, **kw})


def _file_rows(run):
    return [json.loads(l) for l in (run / "eval.jsonl").read_text().splitlines()]


def test_rows_carry_their_key(tiny, run2):
    """Every row names what produced it; the fingerprints are opsd.repro's, the data hash is the content's.
    Break that made it fail: key_weights taken from the base for every step (the adapter not fingerprinted)."""
    _sweep(run2, tiny)
    rows = _file_rows(run2)
    by_step = {r["step"]: r for r in rows}
    for step in (2, 4):
        assert by_step[step]["key_weights"] == weights_fingerprint(
            run2 / "checkpoints" / f"step-{step}" / "adapter_model.safetensors")
    assert by_step[0]["key_weights"] == by_step[0]["key_base"] != by_step[2]["key_weights"] != by_step[4]["key_weights"]
    by_hand = hashlib.sha256(json.dumps([[str(i), p["problem"], p["answer"]] for i, p in enumerate(PROBLEMS)],
                                        sort_keys=True).encode()).hexdigest()[:16]
    assert {r["key_data"] for r in rows} == {by_hand}
    r = rows[0]
    assert (r["key_n"], r["key_k"], r["key_max_new_tokens"], r["key_temperature"], r["key_grade"], r["block_rows"]) \
        == (3, 2, 6, 0.0, "exact", 6)
    assert r["key_dtype"] == "float32" and len({x["setting"] for x in rows}) == 1


def test_changed_setting_evaluates_again(tiny, run2):
    """Only a block with the same key is skipped: each changed setting (or retrained checkpoint) evaluates again.
    Break that made it fail: the done check keyed on (step, seed, split) only (the old rule) -> 0 rows for a
    changed k, budget, data or grader."""
    assert _sweep(run2, tiny).height == 3 * 6
    assert _sweep(run2, tiny, problems=[dict(p) for p in PROBLEMS]).height == 0  # the same content: done
    assert _sweep(run2, tiny, k=1).height == 3 * 3
    assert _sweep(run2, tiny, budget=5).height == 3 * 6
    edited = [PROBLEMS[0], PROBLEMS[1], dict(PROBLEMS[2], answer="16")]
    assert data_hash(edited) != data_hash(PROBLEMS)
    assert _sweep(run2, tiny, problems=edited).height == 3 * 6
    assert _sweep(run2, tiny, grade_mode="math").height == 3 * 6
    _lora(tiny[0], 99, run2 / "checkpoints" / "step-4")  # step 4 retrained: other weights under the same name
    again = _sweep(run2, tiny)
    assert set(again["step"].to_list()) == {4} and again.height == 6
    assert _sweep(run2, tiny).height == 0
    blocks = {(r["step"], r["setting"], r["key_weights"]) for r in _file_rows(run2)}
    assert len(blocks) == 3 * 5 + 1  # five settings x three steps, plus the retrained step 4


def test_summary_counts_the_latest_setting(tiny, run2):
    """Summaries never mix two settings: the latest per run and split, or every one grouped by `setting`.
    Break that made it fail: summarize_eval without current_eval -> k=3 groups mixing the k=2 and k=1 rows."""
    first = _sweep(run2, tiny, k=2, budget=6)
    second = _sweep(run2, tiny, k=1, budget=4)
    s = summarize_eval(read_eval(run2))
    assert s.select("step", "k", "avg_at_k").rows() == summarize_eval(second).select("step", "k", "avg_at_k").rows()
    assert s["k"].to_list() == [1, 1, 1]
    both = summarize_eval(read_eval(run2), settings="all")
    assert both.height == 6 and both["setting"].n_unique() == 2
    by_hand = summarize_eval(first.select(EVAL_COLUMNS + ["run", "step", "seed", "split"]))
    got = both.filter(pl.col("setting") == first["setting"][0]).drop("setting")
    assert got.select(by_hand.columns).rows() == by_hand.rows()


@pytest.mark.parametrize("cut", ["torn line", "whole lines", "block twice"])
def test_partial_block_is_redone(tiny, run2, capsys, cut):
    """A really truncated eval.jsonl (cut inside a line, or between lines as a full disk leaves it) or a block
    written twice: the sweep repairs the file and redoes the block; the file equals the uninterrupted one.
    Break that made it fail: scan_eval counting any block with rows as complete (the cut block stayed short)."""
    _sweep(run2, tiny, seeds=(0, 1))
    path = run2 / "eval.jsonl"
    whole = path.read_bytes()
    lines = whole.split(b"\n")[:-1]
    if cut == "torn line":
        path.write_bytes(whole[: len(whole) - len(lines[-1]) // 2 - 1 - len(lines[-2]) - 1])
    elif cut == "whole lines":
        path.write_bytes(b"\n".join(lines[:-4]) + b"\n")
    else:
        path.write_bytes(whole + b"\n".join(lines[-6:]) + b"\n")
    capsys.readouterr()
    redo = _sweep(run2, tiny, seeds=(0, 1))
    err = capsys.readouterr().err
    assert "removed" in err and "evaluated again" in err
    assert path.read_bytes() == whole
    assert redo.height == (0 if cut == "block twice" else 6)


def test_old_rows_are_not_reused(tiny, run2, capsys):
    """Rows without a key (an older opsd) are kept but never count as done; the sweep says so once.
    Break that made it fail: keyless rows counted as done by (step, seed, split) -> nothing evaluated."""
    _sweep(run2, tiny)
    path = run2 / "eval.jsonl"
    new = path.read_text()
    old = [{k: v for k, v in r.items() if not k.startswith("key_") and k not in ("setting", "block_rows")}
           for r in _file_rows(run2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    capsys.readouterr()
    assert _sweep(run2, tiny).height == 18
    assert capsys.readouterr().err.count("carry no evaluation key") == 1
    assert _sweep(run2, tiny).height == 0 and "carry no evaluation key" not in capsys.readouterr().err
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in old) + new  # nothing deleted
    assert summarize_eval(read_eval(run2)).equals(summarize_eval(pl.read_ndjson(io.StringIO(new))))


def test_skip_done_false_replaces_the_block(tiny, run2):
    """skip_done=False evaluates again and the new block replaces the old one (no repeated rows).
    Break that made it fail: the old block not dropped first -> the block twice in the file."""
    _sweep(run2, tiny)
    before = (run2 / "eval.jsonl").read_bytes()
    assert _sweep(run2, tiny, skip_done=False).height == 18
    assert (run2 / "eval.jsonl").read_bytes() == before  # greedy: the same rows, once


def test_one_writer_at_a_time(tiny, run2):
    """While another process holds the evaluation log's lock, a sweep waits, then writes.
    Break that made it fail: sweep_checkpoints without folder_lock -> eval.jsonl written while the lock was held."""
    out = {}
    with folder_lock(run2 / "eval.jsonl", "the evaluation log"):
        t = threading.Thread(target=lambda: out.update(fr=_sweep(run2, tiny)))
        t.start()
        time.sleep(3)
        assert t.is_alive() and not (run2 / "eval.jsonl").exists()
    t.join(120)
    assert out["fr"].height == 18 and len(_file_rows(run2)) == 18


def test_bad_folders_are_refused_before_loading(tiny, tmp_path, monkeypatch):
    """Run and base-model folders that do not exist, are files or hold no config: one line naming the folder,
    before any model is loaded. Break that made it fail: the folder checks removed (RunDir as given, the model path
    unchecked) -> RunDir's config.json message for a missing folder, a model load for a missing base."""
    import opsd.eval

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(opsd.eval, "load_model", no_load)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()

    def run_with(model):
        rd = tmp_path / f"run-{abs(hash(str(model)))}"
        rd.mkdir()
        (rd / "config.json").write_text(json.dumps(dict(model=str(model), dtype="float32")))
        return rd

    table = [  # (run folder, error type, words of the message)
        (tmp_path / "missing", FileNotFoundError, "no such run folder"),
        (a_file, NotADirectoryError, "not a run folder (it is a file)"),
        (empty, FileNotFoundError, "not a run folder (no config.json)"),
        (run_with(tmp_path / "no-base"), FileNotFoundError, "no-base does not exist"),
        (run_with(a_file), NotADirectoryError, "is a file, not a from_pretrained folder"),
        (run_with(empty), FileNotFoundError, "has no config.json"),
    ]
    for rd, err, words in table:
        with pytest.raises(err) as e:
            eval_runs([rd], PROBLEMS, backend="hf", progress=False)
        msg = str(e.value)
        assert words in msg and "\n" not in msg, msg
        named = rd if "run folder" in words else json.loads((rd / "config.json").read_text())["model"]
        assert str(named) in msg, msg


def test_prompts_longer_than_the_context_are_refused(tiny, run2):
    """A prompt plus the budget over the model's context (512 here) is refused before anything is generated or
    written, naming the longest row; repeated ids too. Break that made it fail: both check_context calls
    (sweep_checkpoints and evaluate) removed -> it generated past the context (DID NOT RAISE)."""
    model, tok = tiny
    long = PROBLEMS + [dict(problem="1 + " * 300 + "1?", answer="301", id="long")]
    with pytest.raises(ValueError, match=r"do not fit the model's context of 512 .* row 'long'"):
        _sweep(run2, tiny, problems=long)
    with pytest.raises(ValueError, match=r"3 of 3 .* do not fit the model's context of 512 tokens with 600"):
        _sweep(run2, tiny, budget=600)
    with pytest.raises(ValueError, match="do not fit"):
        evaluate(model, tok, long, sampling=_greedy())
    with pytest.raises(ValueError, match="id 'a' appears 2 times"):
        _sweep(run2, tiny, problems=[dict(PROBLEMS[0], id="a"), dict(PROBLEMS[1], id="a")])
    assert not (run2 / "eval.jsonl").exists()


def test_scan_eval_by_hand():
    "Complete, incomplete, repeated and keyless rows sorted as counted by hand."
    def blk(step, n, rows=2, seed=0):
        return [dict(step=step, seed=seed, split="test", setting="s", key_weights="w", block_rows=rows,
                     problem_id=str(i), sample=0) for i in range(n)]
    rows = blk(0, 2) + blk(1, 1) + blk(2, 2) + blk(2, 2) + blk(3, 2, seed=1) + [dict(step=9, seed=0, problem_id="x")]
    s = scan_eval(rows)
    assert s["done"] == {(0, 0, "test", "s", "w"), (2, 0, "test", "s", "w"), (3, 1, "test", "s", "w")}
    assert (s["dropped"], s["duplicates"], s["unkeyed"], len(s["rows"])) == (1, 2, 1, 7)
