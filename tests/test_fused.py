"""Exactness of `opsd.fused.fused_divergence` against `opsd.loss.opsd_loss` / `opsd.diagnostics.clip_diagnostics`
on full logits (Liger-style: odd shapes, values and gradients, a tolerance per dtype)."""
import itertools

import pytest
import torch

from opsd.diagnostics import POSITION_KEYS, clip_diagnostics, summarize_diagnostics
from opsd.fused import bf16_case, default_chunk_size, fused_divergence, grad_error
from opsd.loss import opsd_loss

torch.set_num_threads(min(2, torch.get_num_threads()))

TOL = {torch.float64: 1e-10}  # relative; bf16 is checked against a float64 reference below


def case(B=1, T=41, H=37, V=1271, seed=0, spread=0.15, masked=True):
    "float64 hidden states whose per-position KL straddles tau, a weight, labels with ignored positions."
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    noise = spread * torch.rand(B, T, 1, generator=g, dtype=torch.float64) * 2
    ht = hs + noise * torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (B, T), generator=g)
    if masked:
        labels[0, :3] = -100
        labels[-1, -5:] = -100
    return hs.requires_grad_(), ht, w.requires_grad_(), labels


def reference(hs, ht, w, labels, **kw):
    loss = opsd_loss(hs @ w.T, ht @ w.detach().T, labels, **kw)
    return (loss, *torch.autograd.grad(loss, [hs, w]))


def fused(hs, ht, w, labels, **kw):
    loss, diag = fused_divergence(hs, ht, w, labels, **kw)
    return (loss, *torch.autograd.grad(loss, [hs, w])), diag


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


CLIPS = ["none", "entry", "token", "scaled"]
GRID = [(41, c, b, k) for c, b, k in itertools.product(CLIPS, [0.0, 0.5, 1.0], [None, 50])]
GRID += [(401, c, b, None) for c, b in itertools.product(["none", "entry", "token", "scaled"], [0.0, 0.5, 1.0])]

@pytest.mark.parametrize("T,clip,beta,top_k", GRID)
def test_matches_opsd_loss_float64(T, clip, beta, top_k):
    hs, ht, w, labels = case(T=T, seed=T)
    kw = dict(beta=beta, temperature=1.1, clip=clip, tau=0.05, top_k=top_k, num_items=T + 7)
    ref = reference(hs, ht, w, labels, **kw)
    got, _ = fused(hs, ht, w, labels, chunk_size=16, diagnostics=False, **kw)
    assert abs((got[0] - ref[0]).item()) <= TOL[torch.float64] * max(abs(ref[0].item()), 1e-12)
    assert rel(got[1], ref[1]) < TOL[torch.float64]      # student hidden
    assert rel(got[2], ref[2]) < TOL[torch.float64]      # lm_head weight


def test_case_exercises_the_clip():
    hs, ht, w, labels = case(T=401, seed=401)
    d = clip_diagnostics(hs @ w.T, ht @ w.T, temperature=1.1, tau=0.05)
    kl = d["kl/true"]
    assert 0.2 < float((kl > 0.05).double().mean()) < 0.8       # token clip active at some positions only
    assert float(d["entry/argmax_clipped"].double().mean()) > 0.05    # entry clip hits the teacher's argmax
    assert bool(d["entry/neg_loss"].any())


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_diagnostics_match_clip_diagnostics(beta):
    hs, ht, w, labels = case(B=2, T=41, seed=3)
    _, diag = fused(hs, ht, w, labels, beta=beta, temperature=1.1, tau=0.05, chunk_size=7)
    ref = clip_diagnostics((hs @ w.T).detach(), ht @ w.T, labels, beta=beta, temperature=1.1, tau=0.05)
    m = labels != -100
    assert torch.equal(diag["mask"], m)
    for k in POSITION_KEYS:
        assert diag[k].shape == labels.shape and diag[k].dtype == ref[k].dtype, k
        torch.testing.assert_close(diag[k][m].double(), ref[k][m].double(), rtol=1e-10, atol=1e-12, msg=k)
        assert not diag[k][~m].double().abs().sum(), k                 # zeros where ignored
    s1, s2 = summarize_diagnostics(diag), summarize_diagnostics(ref)
    for k in s2: assert s1[k] == pytest.approx(s2[k], rel=1e-9, abs=1e-12), k
    # the per-position loss of the chosen mode sums to the loss
    whole = opsd_loss(hs @ w.T, ht @ w.T, labels, beta=beta, temperature=1.1)
    assert float(diag["loss"][m].sum() / m.sum()) == pytest.approx(float(whole.detach()), rel=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 10_000])
def test_chunked_equals_unchunked(chunk_size):
    hs, ht, w, labels = case(B=2, T=41, seed=5)
    base, _ = fused(hs, ht, w, labels, chunk_size=10_000)
    got, _ = fused(hs, ht, w, labels, chunk_size=chunk_size)
    for a, b in zip(got, base): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_any_leading_shape():
    hs, ht, w, labels = case(B=3, T=13, seed=6)
    a, da = fused(hs, ht, w, labels, chunk_size=8)
    h2 = hs.detach().reshape(39, -1).requires_grad_()
    b, db = fused(h2, ht.reshape(39, -1), w, labels.reshape(39), chunk_size=8)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1].reshape(39, -1), b[1])
    torch.testing.assert_close(a[2], b[2])
    assert da["kl/true"].shape == (3, 13) and db["kl/true"].shape == (39,)


def test_gradient_accumulation_with_num_items():
    "Two micro-batches normalised by the global count sum to the whole batch's loss and gradient."
    hs, ht, w, labels = case(B=2, T=41, seed=7)
    n = int((labels != -100).sum())
    whole, _ = fused(hs, ht, w, labels)
    parts = []
    for i in range(2):
        loss, _ = fused_divergence(hs[i:i + 1], ht[i:i + 1], w, labels[i:i + 1], num_items=n)
        parts.append((loss, *torch.autograd.grad(loss, [hs, w])))
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0])
    torch.testing.assert_close(parts[0][1] + parts[1][1], whole[1])   # rows of the other sample get zero grad
    torch.testing.assert_close(parts[0][2] + parts[1][2], whole[2])


def test_fully_masked_batch_gives_zero_not_nan():
    hs, ht, w, labels = case(T=9, seed=8)
    labels[:] = -100
    (loss, gh, gw), diag = fused(hs, ht, w, labels)
    assert loss.item() == 0.0 and not gh.abs().sum() and not gw.abs().sum()
    assert set(POSITION_KEYS) <= set(diag) and not diag["mask"].any()


def test_teacher_gets_no_gradient_and_frozen_weight_is_fine():
    hs, ht, w, labels = case(T=17, seed=9)
    ht = ht.clone().requires_grad_()
    w = w.detach()
    loss, _ = fused_divergence(hs, ht, w, labels)
    loss.backward()
    assert ht.grad is None and w.grad is None and hs.grad is not None


def test_bf16_inputs_within_half_a_percent_and_bf16_logits_are_not():
    hs, ht, w, labels = bf16_case(n=384, hidden=128, vocab=4096)
    h64 = hs.double().requires_grad_()
    ref = opsd_loss(h64 @ w.double().T, ht.double() @ w.double().T, labels, temperature=1.1)
    ref_g, = torch.autograd.grad(ref, h64)
    hb = hs.clone().requires_grad_()
    loss, _ = fused_divergence(hb, ht, w, labels, temperature=1.1)
    g, = torch.autograd.grad(loss, hb)
    assert g.dtype == torch.bfloat16
    assert float(loss) == pytest.approx(float(ref), rel=1e-4)
    assert grad_error(g, ref_g) < 5e-3
    naive = opsd_loss(hb @ w.T, ht @ w.T, labels, temperature=1.1)          # bf16 logits, as released
    assert grad_error(torch.autograd.grad(naive, hb)[0], ref_g) > 0.05


def test_compiled_chunk_path_matches_eager():
    "The compiled path (the CUDA default) pads the tail chunk to one static shape; same numbers on CPU."
    torch._dynamo.reset()
    hs, ht, w, labels = case(B=1, T=45, H=16, V=300, seed=10)
    hs, ht, w = hs.detach().float().requires_grad_(), ht.float(), w.detach().float().requires_grad_()
    a, da = fused(hs, ht, w, labels, chunk_size=16, compile=False)
    b, db = fused(hs, ht, w, labels, chunk_size=16, compile=True)
    for x, y in zip(a, b): torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(da["entry/grad_cos"], db["entry/grad_cos"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["shape", "labels", "weight", "chunk", "clip"])
def test_bad_input_raises_clearly(bad):
    hs, ht, w, labels = case(T=9, seed=11)
    kw = {}
    if bad == "shape": ht = ht[:, :5]
    if bad == "labels": labels = labels[:, :5]
    if bad == "weight": w = w[:, :5]
    if bad == "chunk": kw["chunk_size"] = 0
    if bad == "clip": kw["clip"] = "bogus"
    with pytest.raises(ValueError, match={"shape": "differ in shape", "labels": "labels", "weight": "lm_head_weight",
                                          "chunk": "chunk_size", "clip": "clip"}[bad]):
        fused_divergence(hs, ht, w, labels, **kw)


def test_default_chunk_size():
    assert default_chunk_size(151936, "cuda") == 256
    assert default_chunk_size(32768, "cpu") == 64
    assert 16 <= default_chunk_size(10**7, "cpu") and default_chunk_size(10, "cuda") == 1024


def test_chunk_fn_plugin_is_what_runs():
    """`fused_divergence(chunk_fn=...)` runs that function in the one chunk loop: the torch chunk math passed in is
    bit-identical to the default and called once per chunk; a wrong per-chunk function changes the results (so a
    plug-in cannot be silently ignored); a misfit one is refused by name; nothing is written into the arguments.
    Break that fails it: the loop ignoring `chunk_fn` (always `chunk_divergence`)."""
    from opsd.fused import chunk_divergence, _FusedDivergence
    hs, ht, w, labels = case(B=2, T=41, seed=12)
    n = int((labels != -100).sum())
    kw = dict(temperature=1.1, clip="entry", tau=0.05, chunk_size=16)
    calls = []
    def counted(zs, zt, **k):
        calls.append(zs.shape[0]); return chunk_divergence(zs, zt, **k)
    base, dbase = fused(hs, ht, w, labels, compile=False, **kw)
    got, dgot = fused(hs, ht, w, labels, chunk_fn=counted, **kw)
    assert calls == [16] * (n // 16) + ([n % 16] if n % 16 else [])
    for a, b in zip(got, base): assert torch.equal(a, b)
    assert list(dgot) == list(dbase) and all(torch.equal(dgot[k], dbase[k]) for k in dbase)
    # a wrong per-chunk function (no clip, whatever the call says) is visible in every output
    def unclipped(zs, zt, **k): return chunk_divergence(zs, zt, **{**k, "clip": "none"})
    bad, dbad = fused(hs, ht, w, labels, chunk_fn=unclipped, **kw)
    assert abs(float(bad[0].detach() - base[0].detach())) > 1e-3
    assert rel(bad[1], base[1]) > 1e-2 and rel(bad[2], base[2]) > 1e-2
    assert not torch.allclose(dbad["update_cos"], dbase["update_cos"])
    # one that breaks the contract is refused, naming it
    def wrong_grad(zs, zt, **k):
        per, g, d = chunk_divergence(zs, zt, **k); return per, g[:, :-1], d
    def no_diag(zs, zt, **k):
        per, g, _ = chunk_divergence(zs, zt, **k); return per, g, {}
    def wrong_dtype(zs, zt, **k):
        per, g, d = chunk_divergence(zs, zt, **k); return per, g.float(), d
    for f in (wrong_grad, no_diag, wrong_dtype):
        with pytest.raises(ValueError, match=f"chunk_fn {f.__name__}"):
            fused_divergence(hs, ht, w, labels, chunk_fn=f, **kw)
    with pytest.raises(ValueError, match="torch chunk math"):
        fused_divergence(hs, ht, w, labels, chunk_fn=counted, compile=True, **kw)
    # outputs are returned: the options passed to the autograd Function come back unchanged
    opts = dict(beta=0.0, temperature=1.1, clip="entry", tau=0.05, top_k=None, diagnostics=True,
                chunk_fn=chunk_divergence, pad=False, chunk_size=16, scale=0.1)
    before = dict(opts)
    out = _FusedDivergence.apply(hs.detach()[0], ht[0], w.detach(), opts)
    assert opts == before and len(out) == 2 + len(POSITION_KEYS)


@pytest.mark.parametrize("clip", ["none", "entry", "token", "scaled"])
def test_matches_handwritten_reference(clip):
    """Loss, both gradients and the clip instruments against forward KL written here with torch only (no opsd.loss):
    e = t log(t / s), entry = sum min(e, tau), token = min(D, tau), scaled = D sg[min(1, tau / D)], autograd.
    Breaks that fail it: the clip rule's kept set by magnitude (`entry_kept(e.abs(), tau)` in `opsd.loss.clip_rule`),
    or the scaled factor without `clamp(max=1)`."""
    hs, ht, w, labels = case(T=401, seed=401)
    T, tau, m = 1.1, 0.05, labels != -100
    s_logp = torch.log_softmax((hs @ w.T) / T, -1)
    t_logp = torch.log_softmax((ht @ w.detach().T) / T, -1)
    e = torch.where(t_logp.exp() > 0, t_logp.exp() * (t_logp - s_logp), 0.0)
    D = e.sum(-1)
    per = {"none": D, "entry": e.clamp(max=tau).sum(-1), "token": D.clamp(max=tau),
           "scaled": D * (tau / D.detach()).clamp(max=1.0)}[clip]
    ref_loss = per[m].sum() / m.sum()
    ref = (ref_loss, *torch.autograd.grad(ref_loss, [hs, w]))
    got, diag = fused(hs, ht, w, labels, temperature=T, clip=clip, tau=tau, chunk_size=64)
    assert abs(float(got[0].detach() - ref[0].detach())) < 1e-12
    assert rel(got[1], ref[1]) < 1e-10 and rel(got[2], ref[2]) < 1e-10
    kept = e.detach() <= tau
    t = t_logp.exp()
    torch.testing.assert_close(diag["loss"][m], per.detach()[m])
    torch.testing.assert_close(diag["entry/loss"][m], e.detach().clamp(max=tau).sum(-1)[m])
    torch.testing.assert_close(diag["entry/clipped_teacher_mass"][m], (t * ~kept).sum(-1)[m])
