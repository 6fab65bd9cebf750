"Tests for opsd.rollout: the Rollout contract on a real tiny Qwen3, seeding, logprobs, left padding, LoRA merge, vLLM mapping."
import copy
import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from opsd.collate import completion_logits
from opsd.loss import sampled_token_logprobs
from opsd.rollout import (HFRollout, Rollout, SamplingConfig, VLLMRollout, finish_rows, left_pad, merged_state_dict,
                          vllm_sampling_kwargs)

torch.set_num_threads(2)
EOS, PAD = 2, 0
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def tiny(seed=0, vocab=67):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
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
    r = HFRollout(model, pad_id=PAD, eos_id=STOPS, batch_size=8).generate(PROMPTS, SamplingConfig(temperature=T, max_new_tokens=7), logprobs=True)
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
    assert HFRollout(model, pad_id=PAD, eos_id=EOS, batch_size=2, progress=False).generate(PROMPTS, sc).completion_ids == alone


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
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                         init_lora_weights=False))
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
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                            "gate_proj", "up_proj", "down_proj"],
                                                         init_lora_weights=False))
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
    ids, mask = left_pad([[5], [6, 7, 8]], 0, multiple=2)
    assert ids.tolist() == [[0, 0, 0, 5], [0, 6, 7, 8]] and mask.sum().item() == 4


def test_vllm_sampling_kwargs():
    kw = vllm_sampling_kwargs(SamplingConfig(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=1024, seed=7), logprobs=True, row=2)
    assert kw == dict(n=1, max_tokens=1024, seed=9, logprobs=0, detokenize=False, skip_special_tokens=False,
                      temperature=1.1, top_p=0.95, top_k=20)
    g = vllm_sampling_kwargs(SamplingConfig(temperature=0, top_k=0))
    assert (g["temperature"], g["top_k"], g["top_p"], g["logprobs"]) == (0.0, -1, 1.0, None)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_vllm_missing_is_a_clear_error():
    with pytest.raises(ImportError, match="needs vLLM"):
        VLLMRollout("/nonexistent")


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_vllm_matches_hf_and_syncs(tmp_path):
    "Greedy vLLM samples equal HF's, and after sync_weights they follow the LoRA-updated student."
    model = tiny(vocab=256)
    model.save_pretrained(tmp_path)
    sc = SamplingConfig(temperature=0, max_new_tokens=8)
    v = VLLMRollout(tmp_path, eos_id=EOS, gpu_memory_utilization=0.2, dtype="float32", max_model_len=64,
                    enforce_eager=True, skip_tokenizer_init=True)
    r = v.generate(PROMPTS, sc, logprobs=True)
    check_contract(r, PROMPTS, 8, (EOS,))
    assert r.completion_ids == HFRollout(model, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc).completion_ids
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    v.sync_weights(pm)
    assert v.generate(PROMPTS, sc).completion_ids == HFRollout(pm, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sc).completion_ids


def test_padding_report_real_tokenizer():
    "padding_report end to end: Qwen3 tokenizer (offline), a random tiny model of its vocabulary, JSON-ready output."
    import json
    from opsd.data import qwen3_tokenizer
    from opsd.rollout import format_padding_report, padding_report
    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)).eval()
    recs = [dict(problem=f"What is {a} + {b}?", solution=f"{a} + {b} = {a + b}." + " Again." * (3 * a), answer=str(a + b))
            for a, b in [(1, 2), (9, 4), (5, 6), (2, 7), (3, 3)]]
    rep = padding_report(m, tok, recs, n=3, seed=1, sampling=SamplingConfig(max_new_tokens=4), gaps=(0, 32))
    json.dumps(rep)
    assert rep["n"] == 3 and len(set(rep["record_idx"])) == 3
    p = rep["perturbation"]
    assert p["aligned"]["kl_max"] < 1e-9 and p["released"]["kl_mean"] > 1e-9
    assert p["pad_gap"]["max"] > 0 and rep["gap_sweep"][0]["kl_max"] == 0.0
    assert "released" in format_padding_report(rep)
    with pytest.raises(ValueError, match="records row 1"):
        padding_report(m, tok, [recs[0], dict(problem="x")])
