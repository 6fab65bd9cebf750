"""opsd.packing (nbs/05f_packing) and the trainer's `padding='packed'`: the aligned layout without its pad columns gives the
padded step's numbers; on CUDA, torch's flash varlen kernel against the per-row reference, forward and backward."""
import pytest
import torch

from opsd.collate import collate, batch_logits
from opsd.packing import pack, packed_logits, use_packed_attention, varlen_reference, flash_varlen
from opsd.train import OPSDConfig, OPSDTrainer
from opsd.bench import cut_completions

CUDA = torch.cuda.is_available()


def _step_cut(tr, cut):
    "Step 1 with the engine's completions cut to fixed lengths, as a real model's stop at EOS anywhere."
    with cut_completions(tr.rollout, lambda call, lens: cut):
        return tr.step(1)


@pytest.mark.parametrize("over", [dict(), dict(loss_kernel="torch"), dict(objective="sampled_token"),
                                  dict(teacher="ema", length_grouping=True)],
                         ids=["logits", "fused", "sampled_token", "ema+grouping"])
def test_packed_step_is_the_padded_step(sharp_ckpt, toy_problems, tmp_path, over):
    """One optimizer step with `padding='packed'` equals the padded aligned step to float64 rounding: loss, instruments,
    grad norm and the updated adapter, with completions of varied lengths (pads inside every micro-batch), for the
    full-logits loss, the fused loss, the sampled-token objective, and the EMA teacher with length grouping. Breaks
    that made it fail: the completion logits read one position late: loss 0.5991 vs 0.6413; the rows attending
    across each other (one causal pass over the whole packed sequence): loss 0.6097 vs 0.6413."""
    from peft.utils import get_peft_model_state_dict
    cut = [12, 2, 9, 1, 11, 3, 2, 10]
    out = {}
    for packed in (False, True):
        cfg = OPSDConfig.toy(model=str(sharp_ckpt), run_dir=str(tmp_path / f"p{packed}"), steps=1, batch_size=8,
                             micro_batch_size=4, sampling=dict(max_tokens=12), log_positions=0,
                             dtype="float64", padding="packed" if packed else "aligned", **over)
        tr = OPSDTrainer(cfg, toy_problems, progress=False)
        out[packed] = (_step_cut(tr, cut), get_peft_model_state_dict(tr.unwrapped))
        name = tr.unwrapped.get_base_model().config._attn_implementation
        assert name == ("opsd_packed_sdpa" if packed else "sdpa")
    for k in ("loss", "kl/true", "entry/argmax_clipped_frac", "entry/grad_cos", "grad_norm", "tokens"):
        if k in out[False][0]: assert out[True][0][k] == pytest.approx(out[False][0][k], rel=1e-10), k
    for k, v in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], v, rtol=1e-9, atol=1e-12)
    assert out[False][0]["grad_norm"] > 0 and out[False][0]["tokens"] == sum(cut)


def test_packed_config_and_inputs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="config field padding='packing': must be one of"):
        OPSDConfig.toy(run_dir=str(tmp_path), padding="packing")
    b = collate([[5, 6], [7]], [[5], [7, 8]], [[1, 2], [3]], pad_id=0, mode="released")
    with pytest.raises(ValueError, match="released layout"):
        pack(b)
    b = collate([[5, 6], [7]], [[5], [7, 8]], [[1, 2], [3]], pad_id=0, mode="aligned")
    b.student_position_ids[1, -2] = 5      # not one run numbered from 0
    with pytest.raises(ValueError, match="student rows are not aligned"):
        pack(b, "student")


def test_padded_calls_and_generation_unchanged(tiny_ckpt):
    """After `use_packed_attention` the model's padded calls and HF generation go through its own sdpa: the same
    logits and the same greedy tokens as before the switch."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float64).eval()
    b = collate([[5, 6, 7], [8]], [[5, 6, 7, 9], [8, 9]], [[10, 11, 12], [13]], pad_id=0, mode="aligned")
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    gen = dict(attention_mask=(ids > 0).long(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        before = (batch_logits(m, b, "student"), m.generate(ids, **gen))
        use_packed_attention(m)
        after = (batch_logits(m, b, "student"), m.generate(ids, **gen))
        packed = packed_logits(m, pack(b, "student"))
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert torch.equal(after[1], before[1])
    mask = b.labels != -100
    torch.testing.assert_close(packed[mask], before[0][mask], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not CUDA, reason="torch's flash varlen kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_matches_reference_on_cuda(dtype):
    """torch's flash varlen kernel (as `flash_varlen` calls it: causal, the model's scale, grouped-query heads) against
    the per-row sdpa reference in float32 on the same inputs, outputs and all three gradients."""
    torch.manual_seed(0)
    lens, H, Hkv, D = [300, 17, 1, 512, 64], 16, 8, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, D, device="cuda", dtype=dtype, requires_grad=True) for h in (H, Hkv, Hkv))
    g = torch.randn(sum(lens), H, D, device="cuda", dtype=dtype)
    got = flash_varlen(q, k, v, cu, max(lens), scale=D ** -0.5 * 0.9)
    dq, dk, dv = torch.autograd.grad(got, (q, k, v), g)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = varlen_reference(q32, k32, v32, cu, scale=D ** -0.5 * 0.9)
    rq, rk, rv = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    for a, r in ((got, ref), (dq, rq), (dk, rk), (dv, rv)):
        err = (a.float() - r).abs().max() / r.abs().max()
        assert err < 2e-2, err


@pytest.mark.skipif(not CUDA, reason="the packed step on the flash kernel needs CUDA")
def test_packed_step_on_cuda_is_close(tmp_path_factory, toy_problems, tmp_path, monkeypatch):
    """The trainer's packed step on CUDA in bfloat16 (flash varlen: head_dim 16, a multiple of 8) against its padded
    step (sdpa): loss and true KL within bf16 noise, the same token count; the flash kernel really ran."""
    from conftest import _tiny_qwen3
    import opsd.packing as P
    ckpt = _tiny_qwen3(tmp_path_factory, "varlen-qwen3", seed=1, initializer_range=0.2, hidden_size=64, head_dim=16)
    calls, flash = [], P.flash_varlen
    monkeypatch.setattr(P, "flash_varlen", lambda *a, **k: calls.append(1) or flash(*a, **k))   # undone after, always
    cut = [12, 2, 9, 1, 11, 3, 2, 10]
    rows = {}
    for packed in (False, True):
        cfg = OPSDConfig.toy(model=str(ckpt), run_dir=str(tmp_path / f"p{packed}"), steps=1, batch_size=8,
                             micro_batch_size=4, sampling=dict(max_tokens=12), log_positions=0,
                             dtype="bfloat16", padding="packed" if packed else "aligned", rollout="hf")
        rows[packed] = _step_cut(OPSDTrainer(cfg, toy_problems, progress=False), cut)
    assert calls, "the packed step did not reach torch's flash varlen kernel"
    assert rows[True]["tokens"] == rows[False]["tokens"] == sum(cut)
    for k in ("loss", "kl/true"):
        assert rows[True][k] == pytest.approx(rows[False][k], rel=3e-2), k


# ATen operators whose result the host must read (on a GPU each waits for the device): `nonzero` and `masked_select`
# size their output from the data, `_local_scalar_dense` is `.item()`, `float()`, `int()` and `bool()` of a tensor
HOST_READS = {"nonzero", "_local_scalar_dense", "is_nonzero", "masked_select", "unique", "repeat_interleave"}


@pytest.mark.parametrize("fused", [True, False], ids=["chunked", "logits"])
def test_packed_step_reads_nothing_back_after_the_move(sharp_ckpt, toy_problems, tmp_path, fused):
    """Between a packed micro-batch's move to the device and the update (forward, loss, backward), no operator whose
    result the host reads: on a GPU each is a sync that leaves the device idle (120 in the H100's training half before
    `host_prepared`). Counted on the CPU with a dispatch mode, so it runs everywhere; the CUDA test below checks the
    same with torch's sync debug mode. Breaks that made it fail (reads in the fused step's two micro-batches): the
    batch moved without `host_prepared` (22: `pack` on the moved batch, the loss's `nonzero`); `fused_divergence`
    without `valid_index` (2); no attention mask (transformers' packed-row test, 4); the tree of 3f943ab (28)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    cfg = OPSDConfig.toy(model=str(sharp_ckpt), run_dir=str(tmp_path / "run"), steps=2, batch_size=4, micro_batch_size=2,
                         sampling=dict(max_tokens=8), padding="packed", log_positions=0, dtype="float32",
                         loss_kernel="auto" if fused else "logits")
    tr = OPSDTrainer(cfg, toy_problems, progress=False)
    tr.step(1)
    reads = []
    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in HOST_READS: reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    fl, bw = tr.forward_loss, tr.acc.backward
    def forward_loss(*a, **k):
        with Reads(): return fl(*a, **k)
    def backward(*a, **k):
        with Reads(): return bw(*a, **k)
    tr.forward_loss, tr.acc.backward = forward_loss, backward
    row = tr.step(2)
    assert row["tokens"] > 0 and row["grad_norm"] > 0
    assert reads == [], reads


@pytest.mark.skipif(not CUDA, reason="host syncs are a CUDA matter")
def test_training_half_waits_for_the_device_nowhere_on_cuda(tmp_path_factory, toy_problems, tmp_path):
    """`backward_all` of a packed bf16 step (fused loss) runs under torch's sync debug mode set to 'error': no blocking
    copy, `.cpu()`, `nonzero` or `float` of a device tensor between the rollout and the update. On an H100 (2026-12-05)
    the packed step waited 120 times (30 per micro-batch) and the GPU never ran ahead of the host. Not yet run on a
    GPU; the CPU test above checks the same seam with each break. (The padded layout still syncs in transformers'
    sdpa mask test, `_ignore_causal_mask_sdpa`.)"""
    from conftest import _tiny_qwen3
    ckpt = _tiny_qwen3(tmp_path_factory, "sync-qwen3", seed=1, initializer_range=0.2, hidden_size=64, head_dim=16)
    cfg = OPSDConfig.toy(model=str(ckpt), run_dir=str(tmp_path / "run"), steps=2, batch_size=8, micro_batch_size=4,
                         sampling=dict(max_tokens=12), padding="packed", log_positions=0, dtype="bfloat16",
                         loss_kernel="auto", rollout="hf")
    tr = OPSDTrainer(cfg, toy_problems, progress=False)
    tr.step(1)                                    # first step: Triton's compiles, lazy allocations
    back = tr.backward_all
    def strict(batches):
        torch.cuda.synchronize(); torch.cuda.set_sync_debug_mode("error")
        try: return back(batches)
        finally: torch.cuda.set_sync_debug_mode("default")
    tr.backward_all = strict
    row = tr.step(2)
    assert row["tokens"] > 0 and row["grad_norm"] > 0


def _fake_varlen(api: str):
    """A stand-in for torch's `varlen_attn` with the signature of one torch release, computing per-row sdpa on the CPU:
    '2.10' (is_causal, no scale, equal head counts) or '2.12' (window_size, scale, enable_gqa)."""
    def rows(q, k, v, cu, causal, scale):
        out = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qq, kk, vv = (x[a:b].transpose(0, 1) for x in (q, k, v))
            out.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale)
                       .transpose(0, 1))
        return torch.cat(out)
    if api == "2.10":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            assert key.shape[1] == query.shape[1], "this torch takes no grouped-query heads"
            return rows(query, key, value, cu_seq_q, is_causal, None)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            if key.shape[1] != query.shape[1]:
                assert enable_gqa, "grouped-query heads need enable_gqa=True"
                key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], 1) for x in (key, value))
            return rows(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)
    return varlen_attn


@pytest.mark.parametrize("api", ["2.10", "2.12"])
def test_flash_varlen_adapts_to_each_torch_signature(monkeypatch, api):
    """`flash_varlen` reads `varlen_attn`'s signature and asks for causal attention, the model's softmax scale and
    grouped-query heads in whatever way that torch release takes them (scaling the queries, repeating key/value heads
    where an argument is missing). Against stand-ins with the signatures of torch 2.10 and 2.12 it equals the per-row
    reference (CPU, float64). Breaks that made it fail: no causal flag ('2.10': full attention in each row); the scale
    dropped where the signature has none."""
    import inspect
    import opsd.packing as P
    fake = _fake_varlen(api)
    monkeypatch.setattr(P, "_varlen_api", lambda: (fake, frozenset(inspect.signature(fake).parameters)))
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q, k, v = (torch.randn(13, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    got = P.flash_varlen(q, k, v, cu, 7, scale=0.2)
    torch.testing.assert_close(got, varlen_reference(q, k, v, cu, scale=0.2), rtol=1e-12, atol=1e-12)
