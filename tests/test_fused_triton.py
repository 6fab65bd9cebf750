"""The Triton chunk kernel (opsd.fused_triton) against the torch reference: values, gradients, every diagnostic.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is
first imported); with one it is compiled for CUDA. `TRITON_INTERPRET=1 pytest ...` forces the interpreter on a GPU host.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from opsd import fused_triton as ft
from opsd.diagnostics import POSITION_KEYS, BOOL_KEYS, loss_grad_diagnostics, synthetic_pair
from opsd.fused import bf16_case, grad_error, fused_divergence
from opsd.loss import divergence

DEVICE = "cpu" if ft.interpreting() else ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None,
                                reason="triton was imported without TRITON_INTERPRET=1 and there is no GPU")
TOL = {torch.float64: 1e-11, torch.float32: 3e-5}


def pair(C, V, dtype, seed=0):
    "Logits whose student disagrees by a per-row amount: some rows clip many entries, some none."
    zs, zt = synthetic_pair(C, V, sharpness=4.0, disagreement=torch.linspace(0.05, 2.0, C), seed=seed)
    return zs.to(DEVICE, dtype), zt.to(DEVICE, dtype)


def compare(zs, zt, block, **kw):
    "Max abs deviation per output of the kernel from `loss_grad_diagnostics` (grad: relative norm error)."
    per, g, d = ft.chunk_divergence_triton(zs, zt, block=block, **kw)
    rper, rg, rd = loss_grad_diagnostics(zs, zt, **kw)
    assert set(d) == set(rd) == set(POSITION_KEYS)
    for k in BOOL_KEYS:
        assert d[k].dtype == torch.bool and torch.equal(d[k], rd[k]), k
    V = zs.shape[-1]
    err = {k: float((d[k].double() - rd[k].double()).abs().max()) for k in POSITION_KEYS if k not in BOOL_KEYS}
    # a share of the V entries: compare the counts it stands for (CUDA may divide by V in float32 even for f64 logits)
    err["entry/clipped_entry_frac"] = float(((d["entry/clipped_entry_frac"].double() * V).round()
                                             - (rd["entry/clipped_entry_frac"].double() * V).round()).abs().max())
    err["per"] = float((per.double() - rper.double()).abs().max())
    err["grad"] = grad_error(g, rg)
    return err, rd


CASES = [("entry", 0.05), ("none", 0.05), ("token", 0.3), ("scaled", 0.3), ("entry", 0.0), (None, 0.05)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("C,V,block", [(7, 1000, 128), (5, 131, 64)], ids=["V1000", "V131"])
@pytest.mark.parametrize("clip,tau", CASES, ids=[f"{c}-{t}" for c, t in CASES])
def test_chunk_matches_reference(dtype, C, V, block, clip, tau):
    zs, zt = pair(C, V, dtype, seed=C)
    err, rd = compare(zs, zt, block, temperature=1.1, clip=clip, tau=tau)
    assert max(err.values()) < TOL[dtype], err
    if clip == "entry" and tau > 0:                       # the data exercises the kept set: some rows clip, some don't
        frac = rd["entry/clipped_entry_frac"]
        assert (frac > 0).any() and (frac == 0).any(), frac
    if clip == "token":
        assert (rd["kl/true"] <= tau).any() and (rd["kl/true"] > tau).any(), rd["kl/true"]


def test_argmax_clipped_exercised_and_ties():
    "Teacher argmax ties across tiles: the first index decides, as torch.argmax; some argmaxes clipped."
    C, V = 6, 300
    g = torch.Generator().manual_seed(3)
    zt = 4.0 * torch.randn(C, V, generator=g, dtype=torch.float64)
    zt[:, 7] = zt[:, 250] = zt.max(-1).values + 1.0        # tie between tile 0 and tile 3 (block 64)
    zs = zt + 0.05 * torch.randn(C, V, generator=g, dtype=torch.float64)   # close everywhere except where pushed below
    zs, zt = zs.to(DEVICE), zt.to(DEVICE)
    zs[:3, 7] -= 6.0                                         # rows 0-2: the first argmax badly under-predicted: clipped
    zs[3:, 250] -= 6.0                                       # rows 3-5: only the second one is
    err, rd = compare(zs, zt, 64, temperature=1.0, clip="entry", tau=0.05)
    assert max(err.values()) < TOL[torch.float64], err
    assert rd["entry/argmax_clipped"][:3].all() and not rd["entry/argmax_clipped"][3:].any()


def test_gradient_is_autograd_gradient():
    "Independent of the closed form: the kernel's gradient is autograd's gradient of sum(divergence)."
    zs, zt = pair(6, 257, torch.float64, seed=1)
    for clip, tau in (("entry", 0.05), ("scaled", 0.3), ("token", 0.3)):
        _, g, _ = ft.chunk_divergence_triton(zs, zt, temperature=0.7, clip=clip, tau=tau, block=64)
        ref = torch.func.grad(lambda z: divergence(z, zt, temperature=0.7, clip=clip, tau=tau).sum())(zs)
        assert grad_error(g, ref) < 1e-11, (clip, grad_error(g, ref))


def test_comparison_can_fail():
    "The tolerances above are tight enough to see a clip bug: entry vs none, or tau off by 20%, is caught."
    zs, zt = pair(7, 1000, torch.float64, seed=7)
    _, g_entry, d = ft.chunk_divergence_triton(zs, zt, clip="entry", tau=0.05, block=128)
    _, g_none, _ = loss_grad_diagnostics(zs, zt, clip="none", tau=0.05)
    _, g_tau, rd = loss_grad_diagnostics(zs, zt, clip="entry", tau=0.06)
    assert grad_error(g_entry, g_none) > 1e-3 and grad_error(g_entry, g_tau) > 1e-4
    assert float((d["entry/loss"] - rd["entry/loss"]).abs().max()) > 1e-4


def test_bf16_gradient_out_and_scale():
    "Written in the GEMM's dtype, scaled by 1/num_items, into a caller's buffer and a column slice of the outputs."
    zs, zt = pair(5, 515, torch.float32, seed=2)
    g = torch.empty(5, 515, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(len(POSITION_KEYS), 9, dtype=torch.float32, device=DEVICE)
    per, g2, _ = ft.chunk_divergence_triton(zs, zt, temperature=1.1, grad_scale=0.25, grad_out=g, out=out[:, 3:8],
                                            block=128)
    rper, rg, _ = loss_grad_diagnostics(zs, zt, temperature=1.1)
    assert g2 is g and g.dtype == torch.bfloat16
    assert grad_error(g.float(), rg * 0.25) < 5e-3
    torch.testing.assert_close(out[1, 3:8], rper, rtol=1e-5, atol=1e-6)
    assert (out[:, :3] == 0).all() and (out[:, 8:] == 0).all()


def run_fused(kernel, hs, ht, w, labels, **kw):
    "opsd.fused.fused_divergence with the Triton per-chunk function ('triton') or the eager torch chunk math ('torch')."
    h, ww = hs.clone().requires_grad_(), w.clone().requires_grad_()
    fn = ft.chunk_fn_for(kernel, DEVICE, beta=kw.get("beta", 0.0), clip=kw.get("clip", "entry"), top_k=kw.get("top_k"))
    assert (fn is ft.chunk_divergence_triton) == (kernel == "triton")
    loss, d = fused_divergence(h, ht, ww, labels, chunk_fn=fn, **(dict(compile=False) if fn is None else {}), **kw)
    loss.backward()
    return loss.detach(), d, h.grad, ww.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32] + ([None] if DEVICE == "cuda" else []),
                         ids=["f64", "f32"] + (["bf16_mixed"] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("clip", ["entry", "scaled"])
def test_fused_matches_torch(dtype, clip):
    "Hidden states -> loss, per-position outputs, both gradients; tail chunk, ignored labels, global num_items."
    hs, ht, w, labels = (x.to(DEVICE) for x in bf16_case(n=45, hidden=16, vocab=333, seed=1))
    if dtype is not None: hs, ht, w = hs.to(dtype), ht.to(dtype), w.to(dtype)
    kw = dict(temperature=1.1, clip=clip, tau=0.05 if clip == "entry" else 0.02, chunk_size=16, num_items=50)
    la, da, ha, wa = run_fused("torch", hs, ht, w, labels, **kw)
    lb, db, hb, wb = run_fused("triton", hs, ht, w, labels, **kw)
    assert list(da) == list(db)
    tol = TOL.get(dtype, 1e-4)
    assert abs(float(la - lb)) <= tol * max(1.0, abs(float(la)))
    for k in da:
        if da[k].dtype == torch.bool: assert torch.equal(da[k], db[k]), k
        else: assert float((da[k].double() - db[k].double()).abs().max()) < tol, k
    gtol = tol if dtype is not None else 1e-2               # bf16 gradients: both round the same fp32 values
    assert grad_error(hb, ha) < gtol and grad_error(wb, wa) < gtol, (grad_error(hb, ha), grad_error(wb, wa))


def test_fused_edge_cases():
    hs, ht, w, labels = (x.to(DEVICE) for x in bf16_case(n=20, hidden=8, vocab=100))
    hs, ht, w = hs.double(), ht.double(), w.double()
    none = torch.full_like(labels, -100)                    # no valid position
    lb, db, hb, _ = run_fused("triton", hs, ht, w, none)
    la, da, _, _ = run_fused("torch", hs, ht, w, none)
    assert float(lb) == 0.0 and (hb == 0).all() and list(da) == list(db)
    lb, db, hb, _ = run_fused("triton", hs, ht, w, labels, diagnostics=False)   # only the loss
    la, da, ha, _ = run_fused("torch", hs, ht, w, labels, diagnostics=False)
    assert set(db) == set(da) == {"loss", "mask"} and abs(float(la - lb)) < 1e-12 and grad_error(hb, ha) < 1e-11
    lb, _, hb, _ = run_fused("triton", hs, ht, w, labels, clip="none", diagnostics=False)  # skips sweep 2
    la, _, ha, _ = run_fused("torch", hs, ht, w, labels, clip="none", diagnostics=False)
    assert abs(float(la - lb)) < 1e-12 and grad_error(hb, ha) < 1e-11


def test_chunk_fn_for():
    "The chooser: None (the torch chunk math) unless the kernel applies; 'triton' raises when it cannot serve."
    assert ft.chunk_fn_for("auto", "cpu") is None and ft.chunk_fn_for("torch", "cuda") is None
    assert ft.chunk_fn_for("auto", "cuda", beta=0.5) is None
    assert ft.chunk_fn_for("auto", "cuda", top_k=10, vocab=1000) is None
    assert ft.chunk_fn_for("auto", "cuda", top_k=10) is None                          # vocabulary unknown: not full
    assert ft.chunk_fn_for("auto", "cuda", clip="token") is ft.chunk_divergence_triton
    assert ft.chunk_fn_for("triton", DEVICE, top_k=1000, vocab=1000) is ft.chunk_divergence_triton  # top_k >= V: full
    assert ft.chunk_fn_for("triton", DEVICE, clip=None) is ft.chunk_divergence_triton
    with pytest.raises(ValueError, match="beta"):
        ft.chunk_fn_for("triton", DEVICE, beta=1.0)
    with pytest.raises(ValueError, match="kernel must be"):
        ft.chunk_fn_for("cuda", DEVICE)
    with pytest.raises(ValueError, match="clip must be"):
        ft.chunk_fn_for("auto", DEVICE, clip="bogus")
    with pytest.raises(ValueError, match="beta"):
        ft.chunk_divergence_triton(*pair(2, 10, torch.float32), beta=0.5)
    hs, ht, w, labels = (x.to(DEVICE) for x in bf16_case(n=12, hidden=8, vocab=40))
    hs, ht, w = hs.float(), ht.float(), w.float()
    a, da = fused_divergence(hs, ht, w, labels, beta=0.5, chunk_fn=ft.chunk_fn_for("auto", DEVICE, beta=0.5))
    b, db = fused_divergence(hs, ht, w, labels, beta=0.5, compile=False)
    torch.testing.assert_close(a, b)
    assert list(da) == list(db)


def test_one_fused_path():
    "fused_triton has no chunk loop or fused entry point of its own, and opsd.fused does not import it."
    import inspect
    import opsd.fused
    assert not hasattr(ft, "fused_divergence") and not hasattr(ft, "fused_divergence_triton")
    assert not [n for n, v in vars(ft).items() if isinstance(v, type) and issubclass(v, torch.autograd.Function)]
    assert "fused_triton" not in inspect.getsource(opsd.fused)


@pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3's vocabulary at the compiled kernel's default tile: CUDA only")
def test_cuda_full_vocabulary():
    zs, zt = pair(16, 151936, torch.float32, seed=5)
    for clip, tau in (("entry", 0.05), ("scaled", 0.3)):
        err, _ = compare(zs, zt, None, temperature=1.1, clip=clip, tau=tau)
        assert max(err.values()) < 1e-4, err
