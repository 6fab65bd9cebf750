"Tests for opsd.padding: the flash-attention-2 emulation, the padding perturbation under sdpa and FA2, the report."
import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input, _upad_input

from opsd.collate import collate, completion_logits
from opsd.padding import (ATTENTION_SEMANTICS, FA2_EMULATION, RELEASED_PADDING, attention_semantics,
                          fa2_emulation_attention, format_padding_report, gap_perturbation, padding_perturbation,
                          padding_report)
from opsd.rollout import SamplingConfig

V = 301  # odd vocabulary


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                      initializer_range=0.1, **kw)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny()


def rows(lengths, seed, lo=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, V, (n,), generator=g).tolist() for n in lengths]


# odd lengths everywhere: prompts 1..41, completions 0..13; row 0 of the teacher is the longest (no gap)
SP, TP, CP = rows([1, 7, 13, 41, 5], 1), rows([41, 13, 1, 7, 29], 2), rows([13, 0, 7, 1, 11], 3)


def _varlen_reference(q, k, v, cu_q, cu_k, scale, groups):
    "flash_attn_varlen_func in plain torch: causal attention inside each packed row."
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        kk, vv = (x[ks:ke].repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), kk, vv, is_causal=True,
                                                                      scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulation_equals_transformers_fa2_path(seed):
    "The emulation equals transformers' padded FA2 branch (_upad_input -> varlen -> _pad_input), reference kernel."
    g = torch.Generator().manual_seed(seed)
    B, T, H, Hkv, D = 4, 11, 6, 2, 8
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    lens = torch.randint(1, T + 1, (B, 3), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):  # random pad patterns: leading, middle and trailing pads, at least one token per row
        keep = torch.rand(T, generator=g) < 0.6
        keep[int(lens[b, 0]) - 1] = True
        mask[b] = keep.long()
    qu, ku, vu, idx, (cq, ck), _ = _upad_input(q, k, v, mask, T, _unpad_input)
    ref = _pad_input(_varlen_reference(qu, ku, vu, cq, ck, D ** -0.5, H // Hkv), idx, B, T)
    mod = torch.nn.Module(); mod.num_key_value_groups, mod.is_causal = H // Hkv, True
    emu, w = fa2_emulation_attention(mod, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                     scaling=D ** -0.5)
    assert w is None and emu.shape == (B, T, H, D)
    assert (emu - ref).abs().max() < 1e-12
    assert emu[mask == 0].abs().max() == 0  # exactly the pad-query rows are zero ...
    assert (emu[mask == 1].abs().amax((-1, -2)) > 0).all()  # ... and only those


def test_emulation_in_a_model_zeros_exactly_pad_queries(model):
    "In a forward pass: attention output 0 at pad queries in every layer; logits at non-pad positions equal sdpa's."
    ids = torch.tensor(rows([12, 12], 5))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    seen = []
    hooks = [l.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
             for l in model.model.layers]
    try:
        with torch.no_grad():
            z_sdpa = model(ids, attention_mask=mask).logits
            seen.clear()
            with attention_semantics(model, "fa2") as m:
                assert m.config._attn_implementation == FA2_EMULATION
                z_fa2 = model(ids, attention_mask=mask).logits
    finally:
        for h in hooks: h.remove()
    assert model.config._attn_implementation == "sdpa"  # restored
    assert len(seen) == len(model.model.layers)
    for a in seen:
        assert a[mask == 0].abs().max() == 0 and (a[mask == 1].abs().amax(-1) > 0).all()
    assert torch.equal(z_fa2[mask == 1], z_sdpa[mask == 1])
    assert (z_fa2[0, 4:7] - z_sdpa[0, 4:7]).abs().amax(-1).min() > 1e-3
    # no padding at all: FA2 runs plain causal attention, like sdpa
    with torch.no_grad():
        z_plain = model(ids).logits
        with attention_semantics(model, "fa2"): assert torch.equal(model(ids).logits, z_plain)


def test_attention_semantics_peft_and_errors(model):
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(tiny(seed=3), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with attention_semantics(pm, "fa2"):
        assert pm.get_base_model().config._attn_implementation == FA2_EMULATION
    assert pm.get_base_model().config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attention semantics"):
        with attention_semantics(model, "flash"): pass
    with pytest.raises(ValueError, match="transformers model"):
        with attention_semantics(torch.nn.Linear(2, 2), "fa2"): pass
    mod = torch.nn.Module(); mod.num_key_value_groups = 1
    with pytest.raises(ValueError, match="2-D"):
        fa2_emulation_attention(mod, *(torch.zeros(1, 1, 2, 4),) * 3, torch.ones(1, 1, 2, 2))


def test_padding_perturbation_sdpa_and_fa2(model):
    out = padding_perturbation(model, 0, SP, TP, CP)
    assert out["attention"] == list(ATTENTION_SEMANTICS)
    n_valid = sum(len(c) for c in CP)
    assert out["rows"]["pad_gap"] == [41 - len(p) for p in TP]
    assert out["pad_gap"]["max"] == 40.0 and out["signal_kl"] > 0
    for a in ATTENTION_SEMANTICS:
        s = out[a]
        assert s["aligned"]["kl_max"] < 1e-9 and s["aligned"]["argmax_agree"] == 1.0
        assert s["aligned"]["positions"] == n_valid
        assert s["aligned_nopos"]["kl_max"] < 1e-6
        assert s["released"]["kl_mean"] > 1e-4
        # the pads are harmless past the first position
        assert s["released_pos"]["kl_rest"] < 1e-9 < s["released_pos"]["kl_first_gap"]
        assert out["rows"]["kl"][a]["released"][0] < 1e-9  # the row without a gap is unperturbed
    # rows with a gap and a non-empty completion: 2, 3, 4 (row 1 has an empty completion)
    assert out["sdpa"]["released"]["first_gap_rows"] == 3
    json.dumps(out)


def test_fa2_changes_only_the_first_position_of_gapped_rows(model):
    "released + FA2 vs released + sdpa: the gap is the only difference, so only the first completion position moves."
    out = padding_perturbation(model, 0, SP, TP, CP, variants=("released", "released_pos", "aligned"))
    sh = out["fa2_vs_sdpa"]
    assert sh["released"]["kl_rest"] == 0.0 and sh["released_pos"]["kl_rest"] == 0.0
    assert sh["released"]["kl_first_gap"] > 1e-3 and sh["released"]["first_gap_rows"] == 3
    assert sh["aligned"]["kl_max"] == 0.0  # left pads precede every real token: FA2 and sdpa agree where it counts
    # the gap-free row's first position is a prompt token, not a pad: unchanged
    assert out["fa2"]["released"]["kl_rest"] == out["sdpa"]["released"]["kl_rest"]
    # directly on logits: only column 0 of the gapped rows differs
    b = collate(SP, TP, CP, 0, mode="released")
    L = b.completion_len
    with torch.no_grad():
        z_s = completion_logits(model, **b.inputs("teacher"), completion_len=L)
        with attention_semantics(model, "fa2"): z_f = completion_logits(model, **b.inputs("teacher"), completion_len=L)
    diff = (z_f - z_s).abs().amax(-1)  # (B, L)
    valid = b.completion_mask
    assert (diff[:, 1:][valid[:, 1:]] == 0).all()
    gapped = (b.pad_gap > 0) & valid[:, 0]
    assert (diff[gapped, 0] > 1e-3).all() and (diff[~gapped & valid[:, 0], 0] == 0).all()


def test_fa2_first_position_sees_no_context(model):
    "Under FA2 the first completion position of a gapped row sees only the pad token: any prompt, the same logits."
    comp = CP[0]
    with torch.no_grad(), attention_semantics(model, "fa2"):
        zs = []
        for prompt in (TP[1], TP[2], TP[3]):  # different prompts, each padded to 41 by the longest row
            b = collate([[1], [1]], [prompt, TP[0]], [comp, comp], 0, mode="released")
            zs.append(completion_logits(model, **b.inputs("teacher"), completion_len=b.completion_len)[0, 0])
    assert (zs[0] - zs[1]).abs().max() < 1e-5 and (zs[0] - zs[2]).abs().max() < 1e-5


def test_perturbation_errors(model):
    with pytest.raises(ValueError, match="who"):
        padding_perturbation(model, 0, SP, TP, CP, who="both")
    with pytest.raises(ValueError, match="attention semantics"):
        padding_perturbation(model, 0, SP, TP, CP, attention=("flash",))
    with pytest.raises(ValueError, match="variants"):
        padding_perturbation(model, 0, SP, TP, CP, variants=("left",))
    only = padding_perturbation(model, 0, SP, TP, CP, attention=("sdpa",))
    assert "fa2" not in only and "fa2_vs_sdpa" not in only


def test_gap_perturbation(model):
    res = gap_perturbation(model, TP, CP, gaps=(0, 3, 40))
    assert [r["gap"] for r in res] == [0, 3, 40]
    assert res[0]["kl_max"] < 1e-12
    assert 0 < res[1]["kl_mean"] and 0 < res[2]["kl_mean"]


def test_padding_report_real_tokenizer():
    "padding_report end to end: Qwen3 tokenizer (offline), a random tiny model of its vocabulary, JSON-ready output."
    from opsd.data import qwen3_tokenizer
    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     tie_word_embeddings=True)).eval()
    recs = [dict(problem=f"What is {a} + {b}?", solution=f"{a} + {b} = {a + b}." + " Again." * (3 * a),
                 answer=str(a + b)) for a, b in [(1, 2), (9, 4), (5, 6), (2, 7), (3, 3)]]
    rep = padding_report(m, tok, recs, n=3, seed=1, sampling=SamplingConfig(max_new_tokens=4), gaps=(0, 32))
    json.dumps(rep)
    assert rep["n"] == 3 and len(set(rep["record_idx"])) == 3 and rep["reference"] == RELEASED_PADDING
    p = rep["perturbation"]
    for a in ATTENTION_SEMANTICS:
        assert p[a]["aligned"]["kl_max"] < 1e-9 < p[a]["released"]["kl_mean"]
    assert p["fa2_vs_sdpa"]["released"]["kl_rest"] == 0.0
    text = format_padding_report(rep)
    assert "fa2" in text and "sdpa" in text and "released" in text and "first|gap" in text
    with pytest.raises(ValueError, match="records row 1"):
        padding_report(m, tok, [recs[0], dict(problem="x")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_emulation_matches_real_flash_attention_2():
    "On a GPU with flash-attn: transformers' real flash_attention_2 zeros the pad queries and matches the emulation."
    pytest.importorskip("flash_attn")
    m = tiny(seed=4).to("cuda", torch.bfloat16)
    ids = torch.tensor(rows([16, 16], 9), device="cuda")
    # released gap + trailing pad; left pads
    mask = torch.tensor([[1] * 5 + [0] * 6 + [1] * 4 + [0], [0] * 3 + [1] * 13], device="cuda")
    seen = []
    hooks = [l.self_attn.o_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach().clone()))
             for l in m.model.layers]
    try:
        with torch.no_grad():
            m.set_attn_implementation("flash_attention_2")
            z_real = m(ids, attention_mask=mask).logits.float()
            real_attn = list(seen); seen.clear()
            m.set_attn_implementation("sdpa")
            with attention_semantics(m, "fa2"):
                z_emu = m(ids, attention_mask=mask).logits.float()
    finally:
        for h in hooks: h.remove()
    for a in real_attn:
        assert a[mask == 0].abs().max() == 0 and (a[mask == 1].abs().amax(-1) > 0).all()
    assert (z_real - z_emu).abs().max() < 0.05  # bf16 kernels differ by rounding only
    assert (z_real[mask == 0] - z_emu[mask == 0]).abs().max() == 0  # pad rows: no attention, identical arithmetic


def test_padding_report_values_by_hand():
    """What `opsd padding --json` prints, value by value, against a recomputation: prompt and completion lengths and
    the pad gap from the records themselves, the signal KL(teacher || student) from unpadded rows, and the released
    layout's perturbation KL(row alone || row in the batch) from the batch built here (teacher prompts right-padded
    to the longest, then the completion, no position_ids), in float64. (tests/test_cli.py::test_padding_json only
    finds two words in the output.) Break that made it fail: `prompt_completion_layout` passing position_ids in
    released mode (released kl_mean 0.079 against the hand-built layout's 0.163)."""
    from opsd.data import student_prompt_ids, teacher_prompt_ids
    from opsd.rollout import HFRollout
    from opsd.toy import TOY_PROMPT, make_problems, toy_tokenizer
    tok = toy_tokenizer()
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2,
                                     tie_word_embeddings=True)).double().eval()
    recs = make_problems(12, seed=0, split="test")
    sampling = SamplingConfig(max_new_tokens=6, seed=3)
    rep = json.loads(json.dumps(padding_report(m, tok, recs, n=4, seed=1, sampling=sampling, prompt_config=TOY_PROMPT,
                                               gaps=(0, 8), attention=("sdpa",)), default=float))  # the CLI's --json
    idx = rep["record_idx"]
    assert rep["n"] == 4 and len(set(idx)) == 4 and all(0 <= i < 12 for i in idx)
    sp = [student_prompt_ids(tok, recs[i]["problem"], TOY_PROMPT) for i in idx]
    tp = [teacher_prompt_ids(tok, recs[i]["problem"], recs[i]["solution"], TOY_PROMPT) for i in idx]
    comps = HFRollout(m, tok, progress=False).generate(sp, sampling).completion_ids
    lens = lambda rows: dict(mean=sum(map(len, rows)) / 4, max=max(map(len, rows)), min=min(map(len, rows)))
    for key, rows in (("teacher_prompt_len", tp), ("student_prompt_len", sp), ("completion_len", comps)):
        for k, v in lens(rows).items(): assert rep[key][k] == pytest.approx(v), (key, k)
    P, L = max(map(len, tp)), max(map(len, comps))
    p = rep["perturbation"]
    assert p["pad_gap"]["mean"] == pytest.approx(sum(P - len(t) for t in tp) / 4)
    assert p["pad_gap"]["max"] == P - min(map(len, tp))
    pad = tok.pad_token_id
    ids = [t + [pad] * (P - len(t)) + c + [pad] * (L - len(c)) for t, c in zip(tp, comps)]
    mask = [[1] * len(t) + [0] * (P - len(t)) + [1] * len(c) + [0] * (L - len(c)) for t, c in zip(tp, comps)]
    kls, sig = [], []
    with torch.no_grad():
        zb = m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        for j, (s, t, c) in enumerate(zip(sp, tp, comps)):
            za = m(torch.tensor([t + c])).logits[0, len(t) - 1:len(t) + len(c) - 1].log_softmax(-1)
            zs = m(torch.tensor([s + c])).logits[0, len(s) - 1:len(s) + len(c) - 1].log_softmax(-1)
            zr = zb[j, P - 1:P + len(c) - 1].log_softmax(-1)
            kls.append((za.exp() * (za - zr)).sum(-1)); sig.append((za.exp() * (za - zs)).sum(-1))
    kl, sig = torch.cat(kls), torch.cat(sig)
    rel = p["sdpa"]["released"]
    assert rel["positions"] == len(kl) == sum(map(len, comps))
    assert rel["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-6)
    assert rel["kl_max"] == pytest.approx(kl.max().item(), rel=1e-6)
    assert rel["kl_mean"] > 1e-4 and p["sdpa"]["aligned"]["kl_max"] < 1e-12
    assert p["signal_kl"] == pytest.approx(sig.mean().item(), rel=1e-6)
    assert rep["gap_sweep"][0]["gap"] == 0 and rep["gap_sweep"][0]["kl_max"] < 1e-12
    assert rep["gap_sweep"][1]["kl_mean"] > 0
