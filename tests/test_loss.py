"Property tests of opsd.loss and opsd.diagnostics on odd shapes (hypothesis)."
import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from opsd.loss import (CLIP_MODES, divergence, divergence_grad, opsd_loss, entry_summands, log_probs,
                       sampled_token_loss, sampled_token_terms)
from opsd.diagnostics import clip_diagnostics, summarize_diagnostics

settings.register_profile("opsd", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("opsd")


@st.composite
def logit_pairs(draw, dtype=torch.float64):
    shape = draw(st.sampled_from([(1, 3), (5, 41), (2, 3, 17), (7, 101), (1, 1, 2, 13)]))
    seed = draw(st.integers(0, 2**16))
    scale_s = draw(st.sampled_from([0.1, 1.0, 3.0, 8.0]))
    scale_t = draw(st.sampled_from([0.1, 1.0, 3.0, 8.0]))
    g = torch.Generator().manual_seed(seed)
    zt = torch.randn(shape, generator=g, dtype=dtype) * scale_t
    zs = zt * draw(st.sampled_from([0.0, 0.5, 1.0])) + torch.randn(shape, generator=g, dtype=dtype) * scale_s
    return zs, zt


def autograd(zs, zt, **kw):
    zs = zs.detach().clone().requires_grad_()
    divergence(zs, zt, **kw).sum().backward()
    return zs.grad


taus = st.sampled_from([0.001, 0.05, 0.3])
betas = st.sampled_from([0.0, 0.25, 0.5, 1.0])
temps = st.sampled_from([0.7, 1.0, 1.1])


@given(logit_pairs(), betas, temps)
def test_none_nonnegative(p, beta, temperature):
    assert (divergence(*p, beta=beta, temperature=temperature) >= -1e-12).all()


@given(logit_pairs(), betas, taus)
def test_entry_le_none_and_tau_inf(p, beta, tau):
    none = divergence(*p, beta=beta)
    assert (divergence(*p, beta=beta, clip="entry", tau=tau) <= none + 1e-12).all()
    torch.testing.assert_close(divergence(*p, beta=beta, clip="entry", tau=math.inf), none)
    for clip in ("token", "scaled"):
        torch.testing.assert_close(divergence(*p, beta=beta, clip=clip, tau=math.inf), none)


@given(logit_pairs(), betas, taus)
def test_token_and_scaled_bounded(p, beta, tau):
    for clip in ("token", "scaled"):
        v = divergence(*p, beta=beta, clip=clip, tau=tau)
        assert (v <= tau + 1e-12).all() and (v >= -1e-12).all()


@given(logit_pairs(), betas, taus, temps)
def test_closed_form_gradients_match_autograd(p, beta, tau, temperature):
    for clip in CLIP_MODES:
        kw = dict(beta=beta, tau=tau, temperature=temperature, clip=clip)
        torch.testing.assert_close(divergence_grad(*p, **kw), autograd(*p, **kw), atol=1e-10, rtol=1e-7)


@given(logit_pairs(), taus)
def test_scaled_gradient_parallel_to_true(p, tau):
    g_true, g_scaled = autograd(*p), autograd(*p, clip="scaled", tau=tau)
    d = divergence(*p)
    for a, b, dv in zip(g_true.reshape(-1, g_true.shape[-1]), g_scaled.reshape(-1, g_true.shape[-1]), d.reshape(-1)):
        if a.norm() > 1e-9:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 1 - 1e-6
            torch.testing.assert_close(b.norm() / a.norm(), torch.clamp(tau / dv, max=1.0), rtol=1e-4, atol=1e-9)


@given(logit_pairs(), taus, temps)
def test_entry_gradient_on_clipped_entries_is_s_tU(p, tau, temperature):
    zs, zt = p
    g = autograd(zs, zt, clip="entry", tau=tau, temperature=temperature)
    s, t = log_probs(zs, temperature).exp(), log_probs(zt, temperature).exp()
    e = entry_summands(s.log(), t.log())
    clipped = e >= tau
    t_u = torch.where(clipped, 0.0, t).sum(-1, keepdim=True)
    expect = torch.where(clipped, s * t_u, s * t_u - t) / temperature
    mask = (e - tau).abs() > 1e-9  # away from the kink
    torch.testing.assert_close(g[mask], expect[mask], atol=1e-10, rtol=1e-7)
    assert (g[clipped & mask] >= 0).all()  # clipped entries are pushed down (or not moved)


@given(logit_pairs())
def test_temperature_and_beta_limits(p):
    zs, zt = p
    # huge temperature: both distributions uniform, every divergence -> 0
    assert divergence(zs, zt, temperature=1e6).abs().max() < 1e-8
    # beta -> 0 or 1 of the generalized JSD, rescaled, approaches forward / reverse KL
    # (the limit needs beta << the smallest probability, so only well-spread pairs qualify)
    eps = 1e-10
    p_min = min(log_probs(zs).exp().min().item(), log_probs(zt).exp().min().item())
    assume(p_min > 1e-5)
    torch.testing.assert_close(divergence(zs, zt, beta=eps) / eps, divergence(zs, zt, beta=0.0), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(divergence(zs, zt, beta=1 - eps) / eps, divergence(zs, zt, beta=1.0),
                               rtol=1e-3, atol=1e-6)
    # identical distributions: zero for every beta
    for beta in (0.0, 0.5, 1.0):
        assert divergence(zt, zt, beta=beta).abs().max() < 1e-12


@given(logit_pairs(), betas, st.sampled_from(list(CLIP_MODES)))
def test_top_k_equal_to_vocab_is_full(p, beta, clip):
    V = p[0].shape[-1]
    torch.testing.assert_close(divergence(*p, beta=beta, clip=clip, top_k=V), divergence(*p, beta=beta, clip=clip))
    # top_k renormalises: a one-entry top-k has zero divergence
    assert divergence(*p, beta=beta, clip=clip, top_k=1).abs().max() < 1e-12


@given(logit_pairs(), st.sampled_from(list(CLIP_MODES)), st.integers(0, 2**16))
def test_masking_and_normalisation(p, clip, seed):
    zs, zt = p
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 5, zs.shape[:-1], generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.4] = -100
    per = divergence(zs, zt, clip=clip)
    mask = labels != -100
    expect = per[mask].sum() / max(int(mask.sum()), 1)
    torch.testing.assert_close(opsd_loss(zs, zt, labels, clip=clip), expect)
    # masked positions have no influence: change their logits arbitrarily
    zs2 = torch.where(mask.unsqueeze(-1), zs, zs * 7 + 3)
    torch.testing.assert_close(opsd_loss(zs2, zt, labels, clip=clip), expect)
    torch.testing.assert_close(opsd_loss(zs, zt, labels, clip=clip, num_items=10), per[mask].sum() / 10)


@given(logit_pairs(dtype=torch.float32), st.sampled_from(list(CLIP_MODES)))
def test_leading_shape_and_dtype_invariance(p, clip):
    zs, zt = p
    V = zs.shape[-1]
    flat = divergence(zs.reshape(-1, V), zt.reshape(-1, V), clip=clip)
    torch.testing.assert_close(divergence(zs, zt, clip=clip).reshape(-1), flat)
    assert divergence(zs.bfloat16(), zt.bfloat16(), clip=clip).dtype == torch.float32
    assert divergence(zs.double(), zt.double(), clip=clip).dtype == torch.float64
    torch.testing.assert_close(divergence(zs.double(), zt.double(), clip=clip).float(), divergence(zs, zt, clip=clip),
                               rtol=1e-4, atol=1e-5)
    # bf16 inputs are computed in fp32 of the rounded values
    torch.testing.assert_close(divergence(zs.bfloat16(), zt.bfloat16(), clip=clip),
                               divergence(zs.bfloat16().float(), zt.bfloat16().float(), clip=clip))


@given(logit_pairs(), taus)
def test_diagnostics_consistent_with_loss(p, tau):
    d = clip_diagnostics(*p, tau=tau)
    torch.testing.assert_close(d["entry/loss"], divergence(*p, clip="entry", tau=tau))
    torch.testing.assert_close(d["loss"], d["entry/loss"])
    torch.testing.assert_close(d["kl/true"], divergence(*p))
    assert ((d["entry/clipped_teacher_mass"] >= 0) & (d["entry/clipped_teacher_mass"] <= 1 + 1e-9)).all()
    assert ((d["entry/grad_cos"] >= -1 - 1e-9) & (d["entry/grad_cos"] <= 1 + 1e-9)).all()
    # nothing clipped -> the clipped gradient is the true gradient
    none_clipped = d["entry/clipped_entry_frac"] == 0
    assert (d["entry/grad_cos"][none_clipped & (d["kl/true"] > 1e-8)] > 1 - 1e-6).all()
    s = summarize_diagnostics(d)
    assert 0 <= s["entry/argmax_clipped_frac"] <= 1
    # the entry instruments do not depend on the clip the run trains with; update_cos does
    for clip in ("none", "scaled"):
        dc = clip_diagnostics(*p, tau=tau, clip=clip)
        torch.testing.assert_close(dc["entry/grad_cos"], d["entry/grad_cos"])
        valid = d["kl/true"] > 1e-8
        assert (dc["update_cos"][valid] > 1 - 1e-6).all() and (dc["loss"] >= -1e-12).all()


def test_fully_masked_batch_is_zero_not_nan():
    zs = torch.randn(2, 3, 7, requires_grad=True)
    loss = opsd_loss(zs, torch.randn(2, 3, 7), torch.full((2, 3), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(zs.grad).all()
    assert sampled_token_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="beta"):
        divergence(torch.randn(2, 3), torch.randn(2, 3), beta=1.5)
    with pytest.raises(ValueError, match="clip"):
        divergence(torch.randn(2, 3), torch.randn(2, 3), clip="per-entry")
    with pytest.raises(ValueError, match="shape"):
        divergence(torch.randn(2, 3), torch.randn(3, 3))
    with pytest.raises(ValueError, match="top_k"):
        divergence(torch.randn(2, 3), torch.randn(2, 3), top_k=-1)


def test_release_off_switches():
    "tau <= 0 means no clip (the release's --jsd_token_clip 0); top_k = 0 means the full vocabulary."
    zs, zt = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
    for clip in ("entry", "token", "scaled"):
        for tau in (0.0, -1.0, None):
            torch.testing.assert_close(divergence(zs, zt, clip=clip, tau=tau), divergence(zs, zt))
            torch.testing.assert_close(divergence_grad(zs, zt, clip=clip, tau=tau), divergence_grad(zs, zt))
    torch.testing.assert_close(divergence(zs, zt, top_k=0), divergence(zs, zt))


def test_entry_boundary_matches_clamp_autograd():
    "An entry exactly at tau keeps its gradient, as torch.clamp(max=tau) (the released code) does."
    from opsd.loss import entry_kept
    e = torch.tensor([0.05, 0.0499, 0.0501], dtype=torch.float64, requires_grad=True)
    e.clamp(max=0.05).sum().backward()
    assert entry_kept(e.detach(), 0.05).tolist() == e.grad.bool().tolist() == [True, True, False]


def test_worked_example_regression():
    t = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    s = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    assert abs(divergence(s.log(), t.log()).item() - 0.27726) < 1e-4
    assert abs(divergence(s.log(), t.log(), clip="entry").item() - (-0.08863)) < 1e-4
    torch.testing.assert_close(divergence_grad(s.log(), t.log(), clip="entry"),
                               torch.tensor([0.12, -0.18, 0.06], dtype=torch.float64))


def _cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-30)


@given(logit_pairs(), betas, taus, st.sampled_from([None, 2]), st.sampled_from([None, *CLIP_MODES]))
def test_diagnostics_cosines_are_divergence_grad_cosines(p, beta, tau, top_k, clip):
    """entry/grad_cos and update_cos are the cosines of `divergence_grad` itself (entry vs none, own clip vs none).
    Break that fails it: `diagnostics_from_terms` using the true gradient as the run's own for 'token'."""
    zs, zt = p
    kw = dict(beta=beta, temperature=1.1, tau=tau, top_k=top_k)
    d = clip_diagnostics(zs, zt, clip=clip, **kw)
    g_true = divergence_grad(zs, zt, clip=None, **kw)
    torch.testing.assert_close(d["entry/grad_cos"], _cos(divergence_grad(zs, zt, clip="entry", **kw), g_true),
                               atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(d["update_cos"], _cos(divergence_grad(zs, zt, clip=clip, **kw), g_true),
                               atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(d["loss"], divergence(zs, zt, clip=clip, **kw))


@given(logit_pairs(), taus, temps)
def test_diagnostics_against_hand_formulas(p, tau, temperature):
    """Every instrument (forward KL) against formulas written here without opsd.loss: e_v = t_v log(t_v/s_v),
    U = {e_v <= tau}, g_true = (s - t)/T, g_entry = (s t_U - t [U])/T, and each clip's value and update factor.
    Breaks that fail it: the clip rule's kept set by magnitude (`entry_kept(e.abs(), tau)` in `clip_rule`),
    or the scaled factor without `clamp(max=1)`."""
    zs, zt = p
    s_logp, t_logp = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    s, t = s_logp.exp(), t_logp.exp()
    e = torch.where(t > 0, t * (t_logp - s_logp), 0.0)
    kl, kept = e.sum(-1), e <= tau
    g_true = (s - t) / temperature
    g_entry = (s * (t * kept).sum(-1, keepdim=True) - t * kept) / temperature
    own = {"none": (kl, torch.ones_like(kl)), "entry": (torch.minimum(e, torch.tensor(tau)).sum(-1), None),
           "token": (torch.minimum(kl, torch.tensor(tau)), (kl <= tau).double()),
           "scaled": (kl * torch.clamp(tau / kl, max=1.0), torch.clamp(tau / kl, max=1.0))}
    for clip in CLIP_MODES:
        d = clip_diagnostics(zs, zt, temperature=temperature, tau=tau, clip=clip)
        torch.testing.assert_close(d["kl/true"], kl)
        torch.testing.assert_close(d["loss"], own[clip][0])
        torch.testing.assert_close(d["entry/loss"], own["entry"][0])
        torch.testing.assert_close(d["entry/clipped_entry_frac"], (~kept).double().mean(-1))
        torch.testing.assert_close(d["entry/clipped_teacher_mass"], (t * ~kept).sum(-1))
        torch.testing.assert_close(d["entry/clipped_student_mass"], (s * ~kept).sum(-1))
        assert torch.equal(d["entry/argmax_clipped"], (~kept).gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1))
        torch.testing.assert_close(d["entry/grad_cos"], _cos(g_entry, g_true), atol=1e-9, rtol=1e-7)
        g_own = g_entry if clip == "entry" else g_true * own[clip][1].unsqueeze(-1)
        torch.testing.assert_close(d["update_cos"], _cos(g_own, g_true), atol=1e-9, rtol=1e-7)
        # the closed-form gradient of each mode, too
        torch.testing.assert_close(divergence_grad(zs, zt, temperature=temperature, clip=clip, tau=tau), g_own,
                                   atol=1e-10, rtol=1e-7)


def test_sampled_token_terms():
    "Per position: -stopgrad(t - s) * s, 0 where masked, gradient -(t - s) through s only; the loss is sum / count."
    g = torch.Generator().manual_seed(0)
    s = (-torch.rand(3, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(3, 7, generator=g) < 0.7
    per = sampled_token_terms(s, t, mask)
    expect = torch.where(mask, -(t - s.detach()) * s.detach(), 0.0)
    torch.testing.assert_close(per.detach(), expect, rtol=0, atol=0)
    per.sum().backward()
    torch.testing.assert_close(s.grad, torch.where(mask, -(t - s.detach()), 0.0), rtol=0, atol=0)
    torch.testing.assert_close(sampled_token_loss(s, t, mask), expect.sum() / mask.sum())
    torch.testing.assert_close(sampled_token_loss(s, t, mask, num_items=40), expect.sum() / 40)
    assert sampled_token_terms(s.float(), t.float(), mask).dtype == torch.float32
    assert sampled_token_terms(s.bfloat16(), t.bfloat16(), mask).dtype == torch.float32
    with pytest.raises(ValueError, match="mask"):
        sampled_token_terms(s, t, mask[:, :3])
