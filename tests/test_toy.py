"Tests of opsd.toy: problems, splits, the slip, the tokenizer, a reduced build -> cache -> from_pretrained -> generate."
import json
import random

import pytest
import torch

from opsd.data import QWEN3_CHAT_TEMPLATE, last_boxed, student_prompt, teacher_prompt
from opsd.data import student_prompt_ids
from opsd.toy import (TOY_PROMPT, TOY_SPECIAL_TOKENS, ToyConfig, build_toy_base, load_toy_base, make_problems,
                      measure_toy, sft_examples, slip_solution, solution_steps, split_of, toy_accuracy, toy_base_path,
                      toy_build_info, toy_config, toy_model, toy_rollout, toy_tokenizer)
from opsd.repro import torch_threads

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, sft_steps=12, warmup_steps=2, batch_size=8, n_eval=0, max_new_tokens=16)


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


# ---------------------------------------------------------------- problems
def test_make_problems_deterministic():
    a = make_problems(50, seed=3)
    assert a == make_problems(50, seed=3)
    assert a != make_problems(50, seed=4)
    assert make_problems(50, seed=3, split="test") == make_problems(50, seed=3, split="test")


def test_splits_disjoint_across_seeds_and_knobs():
    train = {p["problem"] for s in range(4) for p in make_problems(1500, seed=s, split="train")}
    test = {p["problem"] for s in range(4) for p in make_problems(400, seed=s, split="test")}
    test |= {p["problem"] for p in make_problems(300, seed=9, split="test", max_ops=2)}
    assert not train & test
    assert all(split_of(p) == "train" for p in train) and all(split_of(p) == "test" for p in test)
    # about a fifth of problems fall in the test split
    assert 0.17 < sum(split_of(f"x{i}") == "test" for i in range(5000)) / 5000 < 0.23


def test_problem_records_are_correct():
    for p in make_problems(300, seed=1, min_ops=1, max_ops=3):
        assert set(p) == {"problem", "solution", "answer", "id"}
        steps = solution_steps(p["solution"])
        assert 1 <= len(steps) <= 3
        assert eval(p["problem"]) == int(p["answer"]) == steps[-1][3]  # the parenthesised text means what it says
        assert last_boxed(p["solution"]) == p["answer"]
        assert all(0 <= r <= 999 for *_, r in steps)
        assert all(steps[j + 1][0] == steps[j][3] for j in range(len(steps) - 1))
    ids = [p["id"] for p in make_problems(100, seed=1)]
    assert len(set(ids)) == 100
    assert len({p["problem"] for p in make_problems(500, seed=2)}) == 500  # unique by default


def test_make_problems_errors():
    with pytest.raises(ValueError, match="split must be"):
        make_problems(1, split="valid")
    with pytest.raises(ValueError, match="min_ops"):
        make_problems(1, min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="ops must be"):
        make_problems(1, ops="/")
    with pytest.raises(ValueError, match="distinct"):
        make_problems(50, min_ops=1, max_ops=1, max_start=2, max_operand=2, ops="+")


def test_slip_is_consistent_and_wrong():
    rng = random.Random(0)
    for p in make_problems(200, seed=5):
        s = slip_solution(p["solution"], rng)
        steps, orig = solution_steps(s), solution_steps(p["solution"])
        assert len(steps) == len(orig)
        assert last_boxed(s) != p["answer"]
        assert all(steps[j + 1][0] == steps[j][3] for j in range(len(steps) - 1))
        assert [(op, b) for _, op, b, _ in steps] == [(op, b) for _, op, b, _ in orig]  # same operations
        first = next(j for j in range(len(steps)) if steps[j] != orig[j])
        assert abs(steps[first][3] - orig[first][3]) == 1  # the slip is one off
    with pytest.raises(ValueError, match="not a toy solution"):
        slip_solution("no steps here", rng)


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_specials_and_round_trip(tok):
    assert tok.convert_tokens_to_ids(list(TOY_SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.eos_token_id != tok.pad_token_id
    assert len(tok) < 512
    for text in ["12-9=3\n3*8=24\n\\boxed{24}", "arbitrary text ünï 🙂 {}", "<think>\n\n</think>\n\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.convert_ids_to_tokens(tok.encode("905")) == ["9", "0", "5"]
    assert tok.get_vocab() == toy_tokenizer().get_vocab()


def test_tokenizer_chat_template(tok):
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    sp = student_prompt(tok, "(1+2)*3", TOY_PROMPT)
    assert sp == ("<|im_start|>user\nProblem: (1+2)*3\nSolve step by step. Answer in \\boxed{}.<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tp = teacher_prompt(tok, "(1+2)*3", "1+2=3\n3*3=9\n\\boxed{9}", TOY_PROMPT)
    assert "=== Reference Begin ===\n1+2=3\n3*3=9\n\\boxed{9}\n=== Reference End ===\nDerive it yourself" in tp
    assert tp.endswith("<|im_start|>assistant\n")
    ids = tok.encode(sp)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.convert_tokens_to_ids("<think>")) == 1
    assert len(tok.encode(tp)) < 90  # short prompts for a tiny model


# ---------------------------------------------------------------- config and SFT data
def test_presets():
    assert toy_config().slip_frac == ToyConfig().slip_frac == 0.2
    assert toy_config("copy").slip_frac == 0.0
    with pytest.raises(ValueError, match="unknown toy preset"):
        toy_config("nope")
    with pytest.raises(ValueError, match="unknown ToyConfig field"):
        toy_config(hidden=3)
    with pytest.raises(ValueError, match="unknown toy preset"):
        build_toy_base(preset="nope")
    assert toy_base_path(toy_config("soft")) != toy_base_path(toy_config("soft", seed=1))


def test_sft_examples_formats(tok):
    cfg = toy_config(**SMALL)
    P, T, kinds = sft_examples(cfg, tok, n=600)
    n_t = kinds.count("teacher") + kinds.count("slipped")
    assert abs(n_t / 600 - cfg.teacher_frac) < 0.08 and abs(kinds.count("slipped") / n_t - cfg.slip_frac) < 0.1
    for p, t, k in zip(P, T, kinds):
        prompt, target = tok.decode(p), tok.decode(t)
        assert target.endswith("<|im_end|>")
        sol = target[:-len("<|im_end|>")]
        if k == "student":
            assert "Reference" not in prompt
        else:
            ref = prompt.split("=== Reference Begin ===\n")[1].split("\n=== Reference End ===")[0]
            assert (ref == sol) == (k == "teacher")  # slipped references differ, the target stays correct
    _, _, clean = sft_examples(toy_config("copy", **SMALL), tok, n=300)
    assert "slipped" not in clean


# ---------------------------------------------------------------- build, cache, load, generate
def test_build_cache_load_generate(tmp_path, tok):
    cfg = toy_config(**SMALL)
    path = build_toy_base(cfg, cache_dir=tmp_path, progress=False)
    assert path.parent == tmp_path and path.name.startswith("soft-")
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    info = toy_build_info(path)
    assert info["config"] == json.loads(json.dumps(cfg.__dict__)) and info["seconds"] > 0
    assert info["measure"] == {}  # n_eval=0: no measurement
    assert not list(tmp_path.glob("*.tmp*"))  # no leftovers

    # cache reuse: the second call does not retrain (the weights file is untouched)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_toy_base(cfg, cache_dir=tmp_path, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    model, tk = load_toy_base(path)
    assert isinstance(model, Qwen3ForCausalLM) and not model.training
    assert isinstance(AutoModelForCausalLM.from_pretrained(path), Qwen3ForCausalLM)
    assert tk.get_vocab() == tok.get_vocab() and tk.chat_template == QWEN3_CHAT_TEMPLATE
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tk)
    prompts = [student_prompt_ids(tk, p["problem"], TOY_PROMPT) for p in make_problems(4, seed=0, split="test")]
    outs = toy_rollout(model, tk, prompts, max_new_tokens=10)
    assert len(outs) == 4 and all(0 < len(o) <= 10 for o in outs)
    samp = toy_rollout(model, tk, prompts, max_new_tokens=10, temperature=1.0, seed=0)
    assert samp == toy_rollout(model, tk, prompts, max_new_tokens=10, temperature=1.0, seed=0)

    # reproducible: the same config built again gives the same weights
    again = build_toy_base(cfg, cache_dir=tmp_path / "again", progress=False)
    m2, _ = load_toy_base(again)
    for a, b in zip(model.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)

    # force rebuilds; a different config is a different folder
    assert build_toy_base(cfg, cache_dir=tmp_path, force=True, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns != mtime
    copy = build_toy_base(toy_config("copy", **dict(SMALL, n_eval=4)), preset="copy", cache_dir=tmp_path,
                          progress=False)
    assert copy != path and copy.name.startswith("copy-")
    measured = set(toy_build_info(copy)["measure"])
    assert {"student_acc", "teacher_acc", "teacher_top_prob", "student_top_prob"} <= measured


def test_load_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no toy base"):
        load_toy_base(tmp_path)


def test_measure_and_grade(tok):
    probs = make_problems(2, seed=0, split="test")
    right = tok(probs[0]["solution"] + tok.eos_token, add_special_tokens=False)["input_ids"]
    wrong = tok("1+1=2\n\\boxed{-7}", add_special_tokens=False)["input_ids"]
    assert toy_accuracy(tok, [right, wrong], probs) == 0.5 and toy_accuracy(tok, [[], right], probs) == 0.0
    cfg = toy_config(**SMALL)
    model = toy_model(cfg, tok).double().eval()  # float64: batched and one-row greedy decoding pick the same argmax
    with torch.no_grad():  # a random init is near uniform and ignores the prompt: sharpen the outputs and the attention
        model.get_input_embeddings().weight.mul_(8)
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")): p.mul_(10)
    r = measure_toy(model, tok, cfg, n=6)
    want = measure_by_hand(model, tok, cfg, n=6)
    assert r.keys() == want.keys()
    for k in want: assert r[k] == pytest.approx(want[k], abs=6e-5), k  # measure_toy rounds to 4 decimals
    assert 0.1 < r["student_top_prob"] < 0.9 and abs(want["student_top_prob"] - want["teacher_top_prob"]) > 5e-4
    assert r == measure_toy(model, tok, cfg, n=6)  # fixed held-out set and seeded sampling


def measure_by_hand(model, tok, cfg, n, seed=1234, temperature=1.0):
    """`measure_toy` recomputed another way: greedy decoding of each prompt alone with transformers' generate, answers
    read by a regex, top probabilities from one unpadded forward per row. (The sampled rows come from `toy_rollout`.)
    Break that made the comparison fail: `measure_toy` scoring student_top_prob on the teacher prompts."""
    import re
    from opsd.data import teacher_prompt_ids
    probs = make_problems(n, seed=seed, split="test", **cfg.problem_kw())
    sp = [student_prompt_ids(tok, p["problem"], TOY_PROMPT) for p in probs]
    tp = [teacher_prompt_ids(tok, p["problem"], p["solution"], TOY_PROMPT) for p in probs]
    eos = tok.eos_token_id

    def greedy(prompts):
        out = []
        for p in prompts:
            with torch.no_grad():
                seq = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     do_sample=False, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos,
                                     pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
            out.append(seq[:seq.index(eos) + 1] if eos in seq else seq)
        return out

    def acc(comps):  # toy answers are plain integers: the last \boxed{...} must spell it
        boxes = [re.findall(r"\\boxed\{([^{}]*)\}", tok.decode(c, skip_special_tokens=True)) for c in comps]
        return sum(bool(b) and b[-1].strip() == p["answer"] for b, p in zip(boxes, probs)) / n

    def top_prob(prompts, comps):
        tot, cnt = 0.0, 0
        for p, c in zip(prompts, comps):
            if not c: continue
            with torch.no_grad():
                z = model(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1]
            tot += z.softmax(-1).max(-1).values.sum().item(); cnt += len(c)
        return tot / max(cnt, 1)

    sample = lambda prompts, s: toy_rollout(model, tok, prompts, temperature=temperature, seed=s,
                                            max_new_tokens=cfg.max_new_tokens)
    s_samp = sample(sp, seed)
    return dict(student_acc=acc(greedy(sp)), teacher_acc=acc(greedy(tp)), student_sampled_acc=acc(s_samp),
                teacher_sampled_acc=acc(sample(tp, seed + 1)), teacher_top_prob=top_prob(tp, s_samp),
                student_top_prob=top_prob(sp, s_samp), mean_completion_len=sum(map(len, s_samp)) / n)


def test_sft_is_bit_identical_under_any_thread_setting(tmp_path):
    cfg = toy_config(**SMALL)
    weights = []
    for n in (1, 2):
        torch.set_num_threads(n)
        path = build_toy_base(cfg, cache_dir=tmp_path / f"t{n}", progress=False)
        assert torch.get_num_threads() == n  # the caller's setting is restored
        weights.append((path / "model.safetensors").read_bytes())
    torch.set_num_threads(1)
    assert weights[0] == weights[1]
    assert toy_build_info(path)["threads"] == cfg.sft_threads
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
