"""opsd.kernels (nbs/05e_kernels): instance-level kernel patches and compiled decoder layers, against the plain model.

CPU: the patch plumbing with hand-written torch versions of RMSNorm/SiLU/RoPE, `'compile'` (Inductor's C++ backend)
against eager, and the refusals. CUDA (marker `gpu`, skipped without a GPU): `'liger'` and `'compile'` in bf16 under
the trainer's `bf16_adapter_compute`, each as close to a float32 reference as the unpatched bf16 model is.
"""
import copy
import os
import sys

import pytest
import torch

from opsd import kernels
from opsd.kernels import LIGER_PIN, apply_kernels, decoder_stack, fuse_lora, liger_patchers, patch_modules

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_lora(seed=0, layers=2, dtype=torch.float32, hidden=32, heads=2, kv=1, head_dim=16, vocab=128):
    "A tiny real Qwen3 with non-zero LoRA on every projection (so the adapters matter to loss and gradients)."
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True)
    lc = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS)
    return get_peft_model(Qwen3ForCausalLM(cfg).to(dtype), lc)


def batch(L, seed, vocab=128, device="cpu", pad=0):
    "Two rows of length L; the first left-padded by `pad` (mask and position ids as the aligned layout gives them)."
    ids = torch.randint(0, vocab, (2, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[0, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))


def distill_loss(model, inputs):
    "Forward KL(teacher || student) over the unmasked positions; the teacher is the same model with adapters off."
    s = model(**inputs, use_cache=False).logits.float()
    with torch.no_grad(), model.disable_adapter():
        t = model(**inputs, use_cache=False).logits.float()
    keep = inputs["attention_mask"].bool()
    ls, lt = s.log_softmax(-1)[keep], t.log_softmax(-1)[keep]
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def loss_and_grads(model, inputs, ctx=None):
    model.zero_grad(set_to_none=True)
    with (ctx() if ctx else torch.enable_grad()):
        loss = distill_loss(model, inputs)
    loss.backward()
    return loss.detach().double(), {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().clone()
                                    for n, p in model.named_parameters() if p.requires_grad}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _bind(module, fn):
    import types
    module.__dict__["forward"] = types.MethodType(fn, module)


def ref_rms(mod):
    eps = mod.variance_epsilon
    def fwd(self, x):
        h = x.float()
        return self.weight * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    _bind(mod, fwd)


def ref_mlp(mod):
    def fwd(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))
    _bind(mod, fwd)


def bypass_lora_mlp(mod):
    "The deliberate break: an MLP that reads the base weights (as a Liger MLP rebuilt from them would)."
    def fwd(self, x):
        g = self.gate_proj.base_layer(x)
        return self.down_proj.base_layer(g * torch.sigmoid(g) * self.up_proj.base_layer(x))
    _bind(mod, fwd)


def ref_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    def rot(x):
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return torch.cat([a * cos[..., :h] - b * sin[..., :h], b * cos[..., h:] + a * sin[..., h:]], -1)
    return rot(q), rot(k)


def test_patch_modules_keeps_lora_and_stays_on_its_instance():
    """Patched with torch re-implementations, the model gives the plain model's loss and LoRA gradients (left-padded
    rows with position ids included); models built before and after stay plain and the module globals unchanged.
    Break, tried: `bypass_lora_mlp` as the MLP patcher (the adapters skipped inside the patched MLP) makes the
    gradient error O(1) (asserted below as well)."""
    from transformers.models.qwen3 import modeling_qwen3
    rope_before = modeling_qwen3.apply_rotary_pos_emb
    ref = tiny_lora()
    patched = copy.deepcopy(ref)
    counts = patch_modules(patched, rms_norm=ref_rms, mlp=ref_mlp, rope=ref_rope)
    assert counts == dict(rms_norm=1 + 2 * 4, mlp=2, rope=2)
    x = batch(11, seed=3, pad=4)
    (l0, g0), (l1, g1) = loss_and_grads(ref, x), loss_and_grads(patched, x)
    assert min(float(g.norm()) for g in g0.values()) > 0             # every LoRA matrix has a gradient
    assert abs(float(l1 - l0)) <= 1e-4 * float(l0)
    assert max(rel(g1[k], g0[k]) for k in g0) < 1e-4
    assert modeling_qwen3.apply_rotary_pos_emb is rope_before
    later = tiny_lora(seed=1)
    for m in (ref, later):
        layer = decoder_stack(m).layers[0]
        assert "forward" not in vars(layer.mlp) and "forward" not in vars(layer.self_attn)
        assert "forward" not in vars(layer.input_layernorm)
    broken = copy.deepcopy(ref)
    patch_modules(broken, rms_norm=ref_rms, mlp=bypass_lora_mlp, rope=ref_rope)
    _, gb = loss_and_grads(broken, x)
    assert max(rel(gb[k], g0[k]) for k in g0) > 0.1                  # the check above would have caught it


def test_fuse_lora_equals_peft_in_float64(monkeypatch):
    """`fuse_lora`: loss and every LoRA gradient equal peft's to 1e-12 in float64 (left-padded rows, the teacher's
    `disable_adapter()` pass included), one fused product (`_LoraMM`) per adapted projection in the student's pass
    and none in the teacher's; where the plain case does not hold (dropout on one adapter) peft's own forward runs. Breaks, tried
    once each in a working copy: `alpha` left out of the addmm (the loss moved 0.126 -> 0.113); the
    adapters-disabled check removed (28 fused calls instead of 14)."""
    ref = tiny_lora(dtype=torch.float64)
    fused = copy.deepcopy(ref)
    assert fuse_lora(fused) == 7 * 2 and fused.opsd_fused_lora == 14
    calls, apply = [], kernels._LoraMM.apply
    monkeypatch.setattr(kernels._LoraMM, "apply", lambda *a: calls.append(1) or apply(*a))
    x = batch(11, seed=3, pad=4)
    (l0, g0), (l1, g1) = loss_and_grads(ref, x), loss_and_grads(fused, x)
    assert len(calls) == 14
    assert abs(float(l1 - l0)) <= 1e-12 * float(l0) and max(rel(g1[k], g0[k]) for k in g0) < 1e-12
    assert min(float(g.norm()) for g in g0.values()) > 0
    drop = copy.deepcopy(ref)
    decoder_stack(drop).layers[0].mlp.up_proj.lora_dropout["default"] = torch.nn.Dropout(0.0)
    fuse_lora(drop); calls.clear()
    l2, _ = loss_and_grads(drop, x)
    assert len(calls) == 13 and abs(float(l2 - l0)) <= 1e-12 * float(l0)
    with pytest.raises(ValueError, match="no peft LoRA Linear"):
        fuse_lora(torch.nn.Linear(2, 2))


def test_fused_lora_backward_has_no_elementwise_kernels():
    """One adapted projection, forward and backward, counted with the profiler on CPU: peft's path runs its scale and
    add as kernels of their own (aten::mul, aten::add) and autograd adds the base's and the adapter's input gradients;
    the fused path runs none, forward or backward, and gives the same output and gradients to 1e-12 in float64.
    The two accumulations (the output, gx) run in place: an out-of-place addmm copied its accumulator first, 1,600
    device-to-device copies a step on the H200 (bench/h200-2026-12-06).
    Breaks, tried once each: gx as `g W + s (g B) A` written with a `+` (one aten::add counted); `alpha` left out of
    the adapter A's gradient (its gradient off by the factor s = 2); the forward's `y.addmm_` written as
    `torch.addmm(y, ...)`, and the backward's gx likewise (one copy counted each time)."""
    from torch.profiler import profile, ProfilerActivity
    ref = tiny_lora(dtype=torch.float64)
    fused = copy.deepcopy(ref); fuse_lora(fused)
    def run(model):
        q = decoder_stack(model).layers[0].self_attn.q_proj
        x = torch.randn(6, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        g = torch.randn(6, 5, q.out_features, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = q(x); y.backward(g)
        ops = {e.key: e.count for e in prof.key_averages()}
        # an out-of-place addmm(C, a, b) with β != 0 copies C into its output first (a device-to-device copy on CUDA)
        ops["copy of an addmm's C"] = sum(e.name == "aten::copy_" and getattr(e.cpu_parent, "name", "") == "aten::addmm"
                                          for e in prof.events())
        return y.detach(), x.grad, q.lora_A["default"].weight.grad, q.lora_B["default"].weight.grad, ops
    *r, ops_ref = run(ref)
    *f, ops_fused = run(fused)
    for a, b in zip(f, r):
        assert rel(a, b) < 1e-12
    elementwise = ("aten::add", "aten::add_", "aten::mul", "aten::mul_")
    assert sum(ops_ref.get(k, 0) for k in elementwise) >= 2       # peft: the scale and the add at least
    assert sum(ops_fused.get(k, 0) for k in elementwise) == 0, {k: ops_fused.get(k) for k in elementwise}
    assert ops_fused["copy of an addmm's C"] == 0        # the two accumulations (y, gx) in place


def test_fuse_lora_under_autocast_as_close_as_peft(monkeypatch):
    """The trainer's bf16 adapters (bf16 base, float32 adapters, bf16 GEMMs under autocast; here CPU autocast): the
    fused model takes the fused path (14 calls) and its loss and gradients are as close to the float32 model as peft's
    (within 2x + 1e-3, the bound of the Liger test). Break, tried: the autocast clause left out of the dtype check
    (peft's path every time: 0 calls)."""
    ref32 = tiny_lora()
    plain = copy.deepcopy(ref32)
    for n, p in plain.named_parameters():
        if "lora_" not in n: p.data = p.data.to(torch.bfloat16)
    fused = copy.deepcopy(plain); fuse_lora(fused)
    calls, apply = [], kernels._LoraMM.apply
    monkeypatch.setattr(kernels._LoraMM, "apply", lambda *a: calls.append(1) or apply(*a))
    x, ctx = batch(11, seed=3, pad=4), lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    l32, g32 = loss_and_grads(ref32, x)
    lp, gp = loss_and_grads(plain, x, ctx)
    assert calls == []
    lf, gf = loss_and_grads(fused, x, ctx)
    assert len(calls) == 14
    e_plain = (abs(float(lp - l32)) / float(l32), max(rel(gp[k], g32[k]) for k in g32))
    e_fused = (abs(float(lf - l32)) / float(l32), max(rel(gf[k], g32[k]) for k in g32))
    assert e_fused[0] <= 2 * e_plain[0] + 1e-3 and e_fused[1] <= 2 * e_plain[1] + 1e-3, (e_plain, e_fused)


def test_fused_lora_trainer_step_equals_plain(tiny_ckpt, toy_problems, tmp_path):
    """The config field `fused_lora`: two float64 trainer steps with it equal the steps without it (loss, KL, gradient
    norm to 1e-10 relative) and the trainer's model has the fused forward bound. Breaks, tried once each: the trainer
    not calling `fuse_lora` (the bound-forward check fails); `alpha` left out of the addmm (step 2's numbers differ:
    the adapters moved at step 1)."""
    from opsd.train import OPSDConfig, OPSDTrainer
    kw = dict(model=str(tiny_ckpt), steps=2, batch_size=4, micro_batch_size=2, sampling=dict(max_tokens=8), lr=0.05,
              dtype="float64", log_positions=0, save_every=100, padding="aligned")
    with pytest.raises(ValueError, match="fused_lora=True needs lora.dropout=0"):
        OPSDConfig.toy(fused_lora=True, lora=dict(dropout=0.1))
    rows = {}
    for on in (False, True):
        tr = OPSDTrainer(OPSDConfig.toy(run_dir=str(tmp_path / str(on)), fused_lora=on, **kw), toy_problems,
                         progress=False)
        q = decoder_stack(tr.unwrapped).layers[0].self_attn.q_proj
        assert ("forward" in vars(q)) == on
        rows[on] = [tr.step(s) for s in (1, 2)]
    for a, b in zip(rows[False], rows[True]):
        for k in ("loss", "kl/true", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-10), k


def test_compile_matches_eager_without_recompiles():
    """`'compile'` on CPU: loss and LoRA gradients equal eager's to 1e-4 relative at three lengths (padded rows too),
    the graphs are compiled at the first length only, and parameter names are unchanged.
    Breaks, tried: `layer.compile()` with the default `dynamic=None` compiles again at the second length (the graph
    count grows); replacing each layer by `torch.compile(layer)` puts `_orig_mod.` in every layer parameter name."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_lora()
    comp = apply_kernels(copy.deepcopy(eager), "compile")
    assert comp.opsd_kernels == "compile"
    assert list(comp.state_dict()) == list(eager.state_dict())
    graphs = []
    for L, pad in ((9, 3), (13, 5), (6, 2)):
        x = batch(L, seed=L, pad=pad)
        (l0, g0), (l1, g1) = loss_and_grads(eager, x), loss_and_grads(comp, x)
        assert abs(float(l1 - l0)) <= 1e-4 * float(l0), (L, float(l0), float(l1))
        assert max(rel(g1[k], g0[k]) for k in g0) < 1e-4, L
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 2 and graphs == [graphs[0]] * 3, graphs   # student + teacher graphs, then none
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(torch.backends.cpu.get_cpu_capability().lower())


def test_refusals_name_the_fix(monkeypatch):
    "Unknown kernel name, Liger on a CPU model, Liger not installed: one-line errors that say what to do."
    m = tiny_lora()
    with pytest.raises(ValueError, match="must be one of"):
        apply_kernels(m, "fast")
    with pytest.raises(ValueError, match="CUDA device"):
        apply_kernels(m, "liger")
    assert "forward" not in vars(decoder_stack(m).layers[0].mlp)      # refused before anything changed
    monkeypatch.setitem(sys.modules, "liger_kernel", None)            # import fails as when it is not installed
    with pytest.raises(RuntimeError, match=f"pip install {LIGER_PIN}"):
        liger_patchers()
    with pytest.raises(ValueError, match="no decoder layers"):
        apply_kernels(torch.nn.Linear(2, 2), "compile")


# ---------------------------------------------------------------- CUDA

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bf16_case(which):
    """Errors against a float32 reference of the plain model and of the `which` model, both with a bf16 base and fp32
    adapters under the trainer's bf16 adapter compute (autocast, no fp32 cast of LoRA inputs)."""
    from opsd.train import bf16_adapter_compute
    kw = dict(layers=2, hidden=256, heads=4, kv=2, head_dim=64, vocab=1024)
    ref32 = tiny_lora(**kw).cuda()
    plain = copy.deepcopy(ref32)
    for n, p in plain.named_parameters():        # as the trainer holds them: the base in bf16, the adapters in fp32
        if "lora_" not in n: p.data = p.data.to(torch.bfloat16)
    fast = apply_kernels(copy.deepcopy(plain), which) if isinstance(which, str) else which(copy.deepcopy(plain))
    out = []
    for L, pad in ((200, 0), (333, 57)):
        x = batch(L, seed=L, vocab=1024, device="cuda", pad=pad)
        l32, g32 = loss_and_grads(ref32, x)
        (lp, gp), (lf, gf) = (loss_and_grads(m, x, lambda m=m: bf16_adapter_compute(m)) for m in (plain, fast))
        e_plain = (abs(float(lp - l32)) / float(l32), max(rel(gp[k], g32[k]) for k in g32))
        e_fast = (abs(float(lf - l32)) / float(l32), max(rel(gf[k], g32[k]) for k in g32))
        out.append((e_plain, e_fast))
    return fast, out


@gpu
@needs_cuda
def test_liger_matches_plain_bf16():
    """`'liger'` on CUDA: loss and LoRA gradients as close to float32 as the plain bf16 model (within 2x + 1e-3), left
    padding and position ids included, and the modules really run Liger's forwards.
    Break (not yet run on a GPU): an RMSNorm patched with a wrong epsilon or a RoPE with swapped halves moves the
    error far above the plain model's."""
    pytest.importorskip("liger_kernel", reason=f"Liger-Kernel not installed (pip install {LIGER_PIN})")
    fast, errs = _bf16_case("liger")
    layer = decoder_stack(fast).layers[0]
    assert "Liger" in type(layer.mlp).__name__ or "Liger" in layer.mlp._get_name()
    assert layer.self_attn.forward.__func__.__globals__["apply_rotary_pos_emb"].__module__.startswith("liger_kernel")
    for e_plain, e_fast in errs:
        assert e_fast[0] <= 2 * e_plain[0] + 1e-3 and e_fast[1] <= 2 * e_plain[1] + 1e-3, errs


@gpu
@needs_cuda
def test_compile_matches_plain_bf16():
    "`'compile'` on CUDA (Inductor's Triton backend): the same bf16-vs-float32 bound as the Liger test."
    _, errs = _bf16_case("compile")
    for e_plain, e_fast in errs:
        assert e_fast[0] <= 2 * e_plain[0] + 1e-3 and e_fast[1] <= 2 * e_plain[1] + 1e-3, errs


@gpu
@needs_cuda
def test_fused_lora_matches_plain_bf16(monkeypatch):
    """`fused_lora` on CUDA under the trainer's bf16 adapter compute (CUDA autocast): the addmm path runs and loss and
    LoRA gradients stay within the Liger test's bound of the plain model's error against float32. Passed on an H100
    (2026-12-06, the in-place accumulations; the CPU autocast test above covers the same code path)."""
    calls, addmm = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **kw: calls.append(1) or addmm(*a, **kw))
    _, errs = _bf16_case(lambda m: (fuse_lora(m), m)[1])
    assert calls, "the fused path never ran"
    for e_plain, e_fast in errs:
        assert e_fast[0] <= 2 * e_plain[0] + 1e-3 and e_fast[1] <= 2 * e_plain[1] + 1e-3, errs
