"Tests for opsd.collate: layout builder, label masks, pad == eos, errors, completion-aligned logits, pad-gap stats."

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

from opsd.collate import (
    IGNORE_INDEX,
    OPSDBatch,
    as_ids,
    batch_logits,
    collate,
    completion_logits,
    left_pad,
    pad_eos_ids,
    pad_gap_stats,
    pad_gaps,
    pad_rows,
    padded_batch,
    position_ids_from_mask,
    prompt_completion_layout,
    trim_at_eos,
)

V = 301  # odd vocabulary


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    return Qwen3ForCausalLM(cfg).eval()


def rows(lengths, seed, lo=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, V, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, comp):
    return completion_logits(model, torch.tensor([prompt + comp]), completion_len=len(comp))[0]


# odd lengths everywhere: prompts 1..41, completions 0..13
SP, TP, CP = rows([1, 7, 13, 41, 5], 1), rows([41, 13, 1, 7, 29], 2), rows([13, 0, 7, 1, 11], 3)


@pytest.mark.parametrize("mode", ["aligned", "released"])
def test_layout(mode):
    b = collate(SP, TP, CP, pad_id=0, eos_id=None, mode=mode)
    L = max(map(len, CP))
    assert b.completion_len == L and b.labels.shape == (5, L) and b.mode == mode
    assert b.teacher_input_ids.shape == (5, 41 + L) and b.student_input_ids.shape == (5, 41 + L)
    for who, prompts in (("student", SP), ("teacher", TP)):
        kw = b.inputs(who)
        ids, mask = kw["input_ids"], kw["attention_mask"]
        for i, (p, c) in enumerate(zip(prompts, CP)):
            tail = ids[i, ids.shape[1] - L :]
            assert tail[: len(c)].tolist() == c and (tail[len(c) :] == 0).all()
            assert mask[i].sum() == len(p) + len(c)
            assert mask[i, ids.shape[1] - L :].tolist() == [1] * len(c) + [0] * (L - len(c))
            P = ids.shape[1] - L
            real = ids[i, :P][mask[i, :P].bool()].tolist()
            assert real == p
            if mode == "aligned":
                assert mask[i, :P].tolist() == [0] * (P - len(p)) + [1] * len(p)  # left-padded
                pos = kw["position_ids"][i][mask[i].bool()]
                assert pos.tolist() == list(range(len(p) + len(c)))
            else:
                assert mask[i, :P].tolist() == [1] * len(p) + [0] * (P - len(p))  # right-padded: the gap
                assert kw["position_ids"] is None
    for i, c in enumerate(CP):
        assert b.labels[i].tolist() == c + [IGNORE_INDEX] * (L - len(c))
    gap = [41 - len(p) for p in TP]
    assert b.pad_gap.tolist() == (gap if mode == "released" else [0] * 5)
    assert b.num_items == sum(map(len, CP))


@pytest.mark.parametrize("mode", ["aligned", "released"])
def test_logits_against_unpadded(model, mode):
    b = collate(SP, TP, CP, pad_id=0, mode=mode)
    with torch.no_grad():
        for who, prompts, gaps in (("teacher", TP, b.pad_gap), ("student", SP, b.student_pad_gap)):
            z = batch_logits(model, b, who)
            assert z.shape == (5, b.completion_len, V)
            for i, (p, c) in enumerate(zip(prompts, CP)):
                if not c:
                    continue
                err = (z[i, : len(c)] - alone(model, p, c)).abs().max().item()
                if mode == "aligned" or gaps[i] == 0:
                    assert err < 1e-5, (who, i, err)
                else:
                    assert err > 1e-3, (who, i, err)  # the gap moves the logits


def test_aligned_without_position_ids_is_only_a_shift(model):
    "Left padding with no position_ids shifts all positions alike: RoPE is relative, so only float noise."
    b = collate(SP, TP, CP, pad_id=0)
    with torch.no_grad():
        z = completion_logits(model, b.teacher_input_ids, b.teacher_attention_mask, None, b.completion_len)
        for i, (p, c) in enumerate(zip(TP, CP)):
            if c:
                assert (z[i, : len(c)] - alone(model, p, c)).abs().max() < 1e-4


def test_completion_logits_keep_equals_full(model):
    b = collate(SP, TP, CP, pad_id=0)
    with torch.no_grad():
        full = model(**b.inputs("teacher"), use_cache=False).logits
        kept = batch_logits(model, b, "teacher")
    L = b.completion_len
    torch.testing.assert_close(kept, full[:, -L - 1 : -1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="completion_len"):
        completion_logits(model, b.teacher_input_ids, completion_len=b.teacher_input_ids.shape[1])


def test_gap_without_mask_is_not_packed(model):
    "position_ids with a jump and no attention_mask would be read as packed sequences; completion_logits passes a mask."
    p, c = TP[1], CP[0]
    x = torch.tensor([p + c])
    pos = torch.arange(x.shape[1])[None] + 10 * (torch.arange(x.shape[1]) >= len(p))
    with torch.no_grad():
        ours = completion_logits(model, x, position_ids=pos, completion_len=len(c))
        masked = model(x, attention_mask=torch.ones_like(x), position_ids=pos, use_cache=False).logits[
            :, -len(c) - 1 : -1
        ]
    torch.testing.assert_close(ours, masked)


def test_pad_equals_eos():
    eos = 2
    b = collate([[7, eos, 8], [9]], [[9, eos], [eos, 9, 9]], [[5, 6, eos, eos, eos], [5, eos]], pad_id=eos, eos_id=eos)
    assert b.labels.tolist() == [[5, 6, eos], [5, eos, IGNORE_INDEX]]
    # the eos inside prompts and the eos target are real tokens (mask 1); only the padding is masked
    assert b.student_attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]]
    assert b.teacher_attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    # with no eos_id nothing is trimmed and an eos is just a token
    nb = collate([[7]], [[9]], [[5, eos, eos]], pad_id=eos)
    assert nb.labels.tolist() == [[5, eos, eos]]


def test_multiple_eos_ids():
    b = collate([[1]], [[1]], [[5, 7, 6, 2]], pad_id=0, eos_id=(2, 7))
    assert b.labels.tolist() == [[5, 7]]


def test_errors_name_the_row():
    with pytest.raises(ValueError, match="teacher_prompts row 1.*max_prompt_len=4"):
        collate([[1], [1]], [[1], [1] * 5], [[2], [2]], 0, max_prompt_len=4)
    with pytest.raises(ValueError, match="student_prompts row 0: empty"):
        collate([[]], [[1]], [[2]], 0)
    with pytest.raises(ValueError, match="completions row 1"):
        collate([[1], [1]], [[1], [1]], [[2], "abc"], 0)
    with pytest.raises(ValueError, match="counts differ"):
        collate([[1]], [[1], [1]], [[2]], 0)
    with pytest.raises(ValueError, match="empty batch"):
        collate([], [], [], 0)
    with pytest.raises(ValueError, match="mode"):
        collate([[1]], [[1]], [[2]], 0, mode="left")
    with pytest.raises(ValueError, match="truncation"):
        collate([[1]], [[1]], [[2]], 0, truncation="right")
    with pytest.raises(ValueError, match="completion_mask row 0"):
        collate([[1]], [[1]], [[2, 3]], 0, completion_mask=[[0, 1]])


def test_truncation_left():
    b = collate([[1, 2, 3, 4, 5]], [[6, 7, 8]], [[9]], 0, max_prompt_len=3, truncation="left")
    assert b.student_input_ids.tolist() == [[3, 4, 5, 9]]
    assert b.teacher_input_ids.tolist() == [[6, 7, 8, 9]]


def test_empty_completions(model):
    b = collate([[1, 2], [3]], [[4], [5, 6, 7]], [[], [8]], 0)
    assert b.labels.tolist() == [[IGNORE_INDEX], [8]] and b.num_items == 1
    b0 = collate([[1, 2], [3]], [[4], [5, 6, 7]], [[], []], 0, mode="released")
    assert b0.completion_len == 0 and b0.labels.shape == (2, 0) and b0.num_items == 0
    with torch.no_grad():
        assert batch_logits(model, b0).shape == (2, 0, V)


def test_completion_mask_and_tensor_inputs():
    b = collate([torch.tensor([1, 2])], [torch.tensor([3])], [torch.tensor([4, 5, 6])], 0, completion_mask=[[1, 1, 0]])
    assert b.labels.tolist() == [[4, 5]]
    with pytest.raises(ValueError, match="integers"):
        as_ids(torch.tensor([1.0, 2.0]), "completions", 0)


def test_batch_to_and_inputs():
    b = collate([[1]], [[2]], [[3]], 0).to("cpu")
    assert isinstance(b, OPSDBatch) and len(b) == 1
    with pytest.raises(ValueError, match="who"):
        b.inputs("ref")


def test_helpers():
    assert trim_at_eos([4, 2, 2], 2) == [4, 2]
    assert pad_gaps([3, 9, 5, 5, 1], batch_size=2) == [6, 0, 0, 0, 0]
    s = pad_gap_stats([0, 2, 4, 10])
    assert (s["mean"], s["median"], s["max"], s["frac_rows"]) == (4.0, 3.0, 10.0, 0.75)
    assert position_ids_from_mask(torch.tensor([[0, 1, 1, 0]])).tolist() == [[0, 0, 1, 1]]

    class Tok:
        pad_token_id, eos_token_id = None, 7

    assert pad_eos_ids(Tok()) == (7, 7)


lens = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(lens, st.sampled_from(["aligned", "released"]), st.booleans())
def test_layout_property(shape, mode, pad_is_eos):
    "For any lengths: the completion tokens sit in the last L columns, labels mirror them, masks count the real tokens."
    eos = 2
    pad = eos if pad_is_eos else 0
    sp = [[5 + (i + k) % 50 for k in range(a)] for i, (a, _, _) in enumerate(shape)]
    tp = [[eos if k == 0 else 7 for k in range(b)] for _, b, _ in shape]  # a real eos inside each teacher prompt
    cp = [[9] * (c - 1) + [eos] + [eos] * 2 if c else [] for _, _, c in shape]  # eos then eos padding
    b = collate(sp, tp, cp, pad_id=pad, eos_id=eos, mode=mode)
    L = b.completion_len
    want = [c[: c.index(eos) + 1] if c else [] for c in cp]
    assert L == max(map(len, want))
    for i, w in enumerate(want):
        assert b.labels[i, : len(w)].tolist() == w and (b.labels[i, len(w) :] == IGNORE_INDEX).all()
        for ids, mask, p in (
            (b.student_input_ids, b.student_attention_mask, sp[i]),
            (b.teacher_input_ids, b.teacher_attention_mask, tp[i]),
        ):
            assert ids[i, ids.shape[1] - L :][: len(w)].tolist() == w
            assert int(mask[i].sum()) == len(p) + len(w)
            assert ids[i][mask[i].bool()].tolist() == p + w
        if mode == "aligned":
            pos = b.teacher_position_ids[i][b.teacher_attention_mask[i].bool()]
            assert pos.tolist() == list(range(len(tp[i]) + len(want[i])))


def test_pad_rows_and_left_pad():
    ids, mask = left_pad([[5], [6, 7, 8]], 0, multiple=2)  # the generation layout (HFRollout's static-cache rounding)
    assert ids.tolist() == [[0, 0, 0, 5], [0, 6, 7, 8]] and mask.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]
    ids, mask = pad_rows([torch.tensor([1, 2]), (3,)], IGNORE_INDEX, side="right", width=4)
    assert ids.tolist() == [[1, 2, -100, -100], [3, -100, -100, -100]] and mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert left_pad([[1, 2, 3]], 0, multiple=4)[0].shape == (1, 4)
    for bad, msg in (
        (((([1],), 0), dict(side="up")), "side"),
        (((([1],), 0), dict(multiple=0)), "multiple"),
        ((([], 0), {}), "no rows"),
    ):
        with pytest.raises(ValueError, match=msg):
            pad_rows(*bad[0], **bad[1])


def test_padded_batch_scores_rows_as_alone(model):
    "Whole sequences left-padded with positions from the mask give each row's own logits (what the toy scorer needs)."
    seqs = rows([5, 12, 1, 9], 7)
    kw = padded_batch(seqs, pad_id=0)
    assert kw["position_ids"].tolist()[2] == [0] * 12
    with torch.no_grad():
        z = model(**kw).logits
        for i, s in enumerate(seqs):
            zi = model(torch.tensor([s])).logits[0]
            assert (z[i, -len(s) :] - zi).abs().max() < 1e-5
    assert padded_batch(seqs, 0, positions=False)["position_ids"] is None
    ids, mask = pad_rows(seqs, 0, side="right")
    assert padded_batch(seqs, 0, side="right")["input_ids"].equal(ids)


@pytest.mark.parametrize("mode", ["aligned", "released"])
def test_prompt_completion_layout_is_collate(mode):
    "collate lays out both sides with prompt_completion_layout (one builder): same ids, masks, positions, gaps."
    b = collate(SP, TP, CP, pad_id=0, mode=mode)
    for who, prompts, gap in (("student", SP, b.student_pad_gap), ("teacher", TP, b.pad_gap)):
        ids, mask, pos, g = prompt_completion_layout(prompts, CP, 0, mode)
        kw = b.inputs(who)
        assert ids.equal(kw["input_ids"]) and mask.equal(kw["attention_mask"]) and g.equal(gap)
        assert (pos is None and kw["position_ids"] is None) if mode == "released" else pos.equal(kw["position_ids"])
    ids, mask, pos, g = prompt_completion_layout(
        [[4, 5]], [[6]], 0, mode, completion_len=3
    )  # a fixed completion budget
    assert ids.tolist() == [[4, 5, 6, 0, 0]] and mask.tolist() == [[1, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="counts differ"):
        prompt_completion_layout([[1]], [[2], [3]], 0, mode)
    with pytest.raises(ValueError, match="mode"):
        prompt_completion_layout([[1]], [[2]], 0, "left")
