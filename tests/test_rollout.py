"Tests for opsd.rollout: the Rollout contract on a real tiny Qwen3, seeding, logprobs, padding, LoRA merge, vLLM."
import copy
import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from opsd.collate import completion_logits
from opsd.loss import sampled_token_logprobs
from opsd.rollout import (HFRollout, Rollout, SamplingConfig, VLLMRollout, finish_rows, make_rollout,
                          merged_state_dict, resolve_backend, vllm_env, vllm_sampling_kwargs)

torch.set_num_threads(2)
EOS, PAD = 2, 0
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def tiny(seed=0, vocab=67):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny()


PROMPTS = [[1, 10, 11, 12], [1, 13], [1, 14, 15, 16, 17, 18, 19], [1, 20, 21], [1, 30, 31, 32, 33]]
STOPS = (EOS, 12)  # a second stop id so that a random model stops early in some rows


def check_contract(r: Rollout, prompts, max_new, stops):
    assert isinstance(r, Rollout) and len(r) == len(prompts)
    assert r.prompt_ids == prompts
    for c, m, f in zip(r.completion_ids, r.completion_mask, r.finish_reason):
        assert m == [1] * len(c)
        assert not set(stops) & set(c[:-1]), "a stop token inside a completion: not trimmed"
        assert f in ("stop", "length")
        assert (f == "stop") == (bool(c) and c[-1] in stops)
        assert len(c) <= max_new
        if f == "length": assert len(c) == max_new
    assert r.seconds > 0 and r.tokens_per_s > 0


def test_contract_and_determinism(model):
    sc = SamplingConfig(max_new_tokens=9, seed=3)
    hf = HFRollout(model, pad_id=PAD, eos_id=STOPS, batch_size=2, progress=False)
    state = torch.random.get_rng_state()
    r1 = hf.generate(PROMPTS, sc)
    assert torch.equal(state, torch.random.get_rng_state()), "generate must not move the global RNG"
    check_contract(r1, PROMPTS, 9, STOPS)
    assert set(r1.finish_reason) == {"stop", "length"}
    assert r1.logprobs is None
    r2 = hf.generate(PROMPTS, sc)
    assert r2.completion_ids == r1.completion_ids
    r3 = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=9, seed=4))
    assert r3.completion_ids != r1.completion_ids


def test_logprobs_match_forward(model):
    T = 1.3
    sc = SamplingConfig(temperature=T, max_new_tokens=7)
    r = HFRollout(model, pad_id=PAD, eos_id=STOPS, batch_size=8).generate(PROMPTS, sc, logprobs=True)
    assert len(r.logprobs) == len(PROMPTS)
    for p, c, lp in zip(r.prompt_ids, r.completion_ids, r.logprobs):
        assert len(lp) == len(c)
        with torch.no_grad():
            z = completion_logits(model, torch.tensor([p + c]), completion_len=len(c))[0]
        torch.testing.assert_close(torch.tensor(lp), sampled_token_logprobs(z, torch.tensor(c), T), atol=1e-4, rtol=0)
        # and not at temperature 1: the temperature is applied
        assert not torch.allclose(torch.tensor(lp), sampled_token_logprobs(z, torch.tensor(c), 1.0), atol=1e-3)


def test_left_padding_keeps_greedy_output(model):
    sc = SamplingConfig(temperature=0, max_new_tokens=8)
    batched = HFRollout(model, pad_id=PAD, eos_id=EOS, batch_size=16).generate(PROMPTS, sc)
    alone = [HFRollout(model, pad_id=PAD, eos_id=EOS).generate([p], sc).completion_ids[0] for p in PROMPTS]
    assert batched.completion_ids == alone
    check_contract(batched, PROMPTS, 8, (EOS,))
    # chunking does not matter for greedy decoding either
    chunked = HFRollout(model, pad_id=PAD, eos_id=EOS, batch_size=2, progress=False)
    assert chunked.generate(PROMPTS, sc).completion_ids == alone


def test_pad_equals_eos(model):
    sc = SamplingConfig(temperature=0, max_new_tokens=8)
    a = HFRollout(model, pad_id=EOS, eos_id=EOS).generate(PROMPTS, sc)
    b = HFRollout(model, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc)
    assert a.completion_ids == b.completion_ids


def test_tokenizer_ids_and_errors(model):
    class Tok:
        pad_token_id, eos_token_id = None, EOS
    hf = HFRollout(model, Tok())
    assert (hf.pad_id, hf.eos_id) == (EOS, EOS)
    with pytest.raises(ValueError, match="pad and eos"):
        HFRollout(model)
    with pytest.raises(ValueError, match="prompt_ids row 1"):
        hf.generate([[1, 2], []], SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_peft_model_and_training_mode(model):
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    pm = get_peft_model(copy.deepcopy(model), lc)
    pm.train()
    sc = SamplingConfig(temperature=0, max_new_tokens=8)
    hf = HFRollout(pm, pad_id=PAD, eos_id=EOS)
    with_lora = hf.generate(PROMPTS, sc).completion_ids
    assert pm.training, "generate must restore training mode"
    with pm.disable_adapter():
        base = hf.generate(PROMPTS, sc).completion_ids
    assert base == HFRollout(model, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc).completion_ids
    assert with_lora != base


def test_merged_state_dict_equals_merge_and_unload(model):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lc = LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    pm = get_peft_model(copy.deepcopy(model), lc)
    sd = merged_state_dict(pm)
    ref = copy.deepcopy(pm).merge_and_unload().state_dict()
    assert sorted(sd) == sorted(ref) == sorted(model.state_dict())
    for k in ref:
        torch.testing.assert_close(sd[k], ref[k], atol=1e-6, rtol=0)
    changed = [k for k in ref if not torch.equal(sd[k], model.state_dict()[k])]
    assert len(changed) == 2 * 7  # 2 layers x 7 target modules
    assert merged_state_dict(pm, dtype=torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16
    # the training model is untouched and still has its adapters
    assert any("lora_A" in k for k in pm.state_dict())
    # the merged weights generate what the peft model generates
    plain = copy.deepcopy(model)
    plain.load_state_dict(sd)
    sc = SamplingConfig(temperature=0, max_new_tokens=8)
    assert (HFRollout(plain, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc).completion_ids
            == HFRollout(pm, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc).completion_ids)


def test_helpers():
    assert finish_rows([[4, 2, 0], [4, 5, 6]], 2, 3) == ([[4, 2], [4, 5, 6]], ["stop", "length"])


def test_vllm_sampling_kwargs():
    sc = SamplingConfig(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=1024, seed=7)
    kw = vllm_sampling_kwargs(sc, logprobs=True, row=2)
    assert kw == dict(n=1, max_tokens=1024, seed=9, logprobs=0, detokenize=False, skip_special_tokens=False,
                      temperature=1.1, top_p=0.95, top_k=20)
    g = vllm_sampling_kwargs(SamplingConfig(temperature=0, top_k=0))
    assert (g["temperature"], g["top_k"], g["top_p"], g["logprobs"]) == (0.0, -1, 1.0, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_backend_choice_on_cpu(model):
    "auto -> HF without a GPU; vllm -> an error naming the fix; the trainer's calls exist on HF and change nothing."
    assert resolve_backend("auto") == "hf" and resolve_backend("hf") == "hf"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("vLLM")
    with pytest.raises(RuntimeError, match="rollout='hf'"):
        resolve_backend("vllm")
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        VLLMRollout("/nonexistent")
    tok = type("Ids", (), dict(pad_token_id=PAD, eos_token_id=EOS))()
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        make_rollout("vllm", model, tok, "/nonexistent")
    ro = make_rollout("auto", model, tok, None, max_model_len=64, gpu_memory_utilization=0.3, sleep=True, seed=0,
                      progress=False)
    assert isinstance(ro, HFRollout)
    sc = SamplingConfig(temperature=0, max_new_tokens=6)
    before = ro.generate(PROMPTS, sc).completion_ids
    ro.sleep(), ro.wake_up(), ro.sync_weights(model)
    assert ro.generate(PROMPTS, sc).completion_ids == before


def test_vllm_env_keeps_user_settings(monkeypatch):
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    set_now = vllm_env()
    import os
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1" and "VLLM_USE_FLASHINFER_SAMPLER" not in set_now
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" == set_now["VLLM_ENABLE_V1_MULTIPROCESSING"]


# the vLLM checks on a GPU are in tests/test_gpu.py


def test_each_vllm_request_is_seeded_and_the_removed_seeding_field_is_read(tmp_path):
    """Request i carries the seed seed + i (a row's completion does not depend on its batch). Run configs written while
    `sample_seeding` existed (2026-12-04/05) hold `sample_seeding: 'row'`: they still load, as today's way; `'call'`
    (removed: its seed did not repeat on vLLM) is refused with the field named. Break that made it fail: the field
    not dropped before the unknown-field check."""
    from opsd.rollout import SamplingConfig, vllm_sampling_kwargs
    from opsd.train import OPSDConfig
    assert [vllm_sampling_kwargs(SamplingConfig(seed=3), row=r)["seed"] for r in (0, 1)] == [3, 4]
    d = OPSDConfig.toy(run_dir=str(tmp_path)).to_dict()
    assert OPSDConfig.from_dict({**d, "sample_seeding": "row"}) == OPSDConfig.from_dict(d)
    with pytest.raises(ValueError, match="sample_seeding='call' was removed"):
        OPSDConfig.from_dict({**d, "sample_seeding": "call"}, source="runs/x/config.json")
