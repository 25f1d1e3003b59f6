"""CPU tests of flash_cute.reference.attention: the ground truth everything else is checked against."""

import math

import pytest
import torch

from flash_cute.reference.attention import (
    attention_mask,
    attention_ref,
    normalize_window,
    score_attention_ref,
    tolerance_check,
)


def _randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _qkv(gen, batch, seqlen_q, seqlen_k, nheads, nheads_kv, hdim, hdim_v, dtype=torch.float64):
    return (
        _randn(gen, batch, seqlen_q, nheads, hdim, dtype=dtype),
        _randn(gen, batch, seqlen_k, nheads_kv, hdim, dtype=dtype),
        _randn(gen, batch, seqlen_k, nheads_kv, hdim_v, dtype=dtype),
    )


def _loop_mask(seqlen_q, seqlen_k, left, right):
    """The visibility rule written out literally, independent of attention_mask."""
    off = seqlen_k - seqlen_q
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            ok_left = left is None or j >= i + off - left
            ok_right = right is None or j <= i + off + right
            mask[i, j] = ok_left and ok_right
    return mask


def _naive_attention(q, k, v, scale, mask, softcap):
    """Per-(batch, head) dense softmax with torch.softmax, GQA by index."""
    batch, seqlen_q, nheads, _ = q.shape
    group = nheads // k.shape[2]
    out = torch.zeros(batch, seqlen_q, nheads, v.shape[3], dtype=torch.float64)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(nheads):
            s = (q[b, :, h] @ k[b, :, h // group].T) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~mask, -math.inf)
            rows = mask.any(dim=1)
            out[b, rows, h] = torch.softmax(s[rows], dim=-1) @ v[b, :, h // group]
            lse[b, h, rows] = torch.logsumexp(s[rows], dim=-1)
    return out, lse


# --------------------------------------------------------------------------- masks


def test_attention_mask_hand_examples():
    # seqlen_q < seqlen_k: the last query row lines up with the last key.
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(2, 4, causal=True), expected)
    # seqlen_q > seqlen_k: the two leading rows see nothing.
    expected = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(4, 2, causal=True), expected)
    # Local window (1, 1) on a square: a tridiagonal band.
    band = attention_mask(4, 4, window_size=(1, 1)).int()
    assert torch.equal(band, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]))


@pytest.mark.parametrize("seed", range(3))
def test_attention_mask_matches_literal_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(30):
        sq, sk = (int(x) for x in torch.randint(1, 12, (2,), generator=gen))
        left, right = (int(x) if x >= 0 else None for x in torch.randint(-2, 6, (2,), generator=gen))
        assert torch.equal(attention_mask(sq, sk, window_size=(left, right)), _loop_mask(sq, sk, left, right))


def test_window_conventions():
    # Negative ints mean unbounded; causal forces right = 0 and keeps left.
    assert normalize_window(False, (-1, -1)) == (None, None)
    assert normalize_window(True, (3, None)) == (3, 0)
    assert normalize_window(True, (-1, 5)) == (None, 0)
    assert torch.equal(attention_mask(5, 7, True, (2, None)), attention_mask(5, 7, False, (2, 0)))
    assert attention_mask(5, 7, False, (-1, -1)).all()
    with pytest.raises(ValueError):
        normalize_window(False, (1, 2, 3))


# --------------------------------------------------------------------------- forward values


@pytest.mark.parametrize(
    "sq, sk, causal, window, softcap",
    [
        (7, 7, False, (None, None), 0.0),
        (5, 13, True, (None, None), 0.0),
        (13, 5, True, (None, None), 0.0),
        (9, 11, False, (3, 2), 0.0),
        (11, 9, True, (4, None), 0.0),
        (6, 10, False, (None, None), 5.0),
        (10, 6, True, (2, None), 2.0),
    ],
)
def test_matches_naive_softmax(sq, sk, causal, window, softcap):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = _qkv(gen, 2, sq, sk, 4, 2, 16, 12)
    scale = 0.37
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    left, right = normalize_window(causal, window)
    out_n, lse_n = _naive_attention(q, k, v, scale, _loop_mask(sq, sk, left, right), softcap)
    assert out.shape == (2, sq, 4, 12) and lse.shape == (2, 4, sq)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_n, rtol=1e-12, atol=1e-12)


def test_default_scale_is_inverse_sqrt_hdim():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, 1, 5, 7, 2, 2, 9, 3)
    out, lse = attention_ref(q, k, v)
    out_s, lse_s = attention_ref(q, k, v, softmax_scale=1 / 3)
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s)


def test_causal_bottom_right_outputs():
    gen = torch.Generator().manual_seed(2)
    # One query against three keys: bottom-right causal sees every key.
    q, k, v = _qkv(gen, 1, 1, 3, 1, 1, 4, 2)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True), attention_ref(q, k, v))
    # Three queries against one key: rows 0, 1 see nothing, row 2 copies v[0].
    q, k, v = _qkv(gen, 1, 3, 1, 1, 1, 4, 2)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.equal(out[0, :2], torch.zeros(2, 1, 2, dtype=torch.float64))
    assert torch.isneginf(lse[0, 0, :2]).all()
    torch.testing.assert_close(out[0, 2, 0], v[0, 0, 0])
    torch.testing.assert_close(lse[0, 0, 2], (q[0, 2, 0] @ k[0, 0, 0]) / 2)


def test_gqa_equals_repeated_kv_heads():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(gen, 2, 9, 11, 6, 2, 8, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    # Query head h uses kv head h // 3: heads 0-2 -> kv 0, heads 3-5 -> kv 1.
    kv_head = [0, 0, 0, 1, 1, 1]
    k_rep, v_rep = k[:, :, kv_head], v[:, :, kv_head]
    out_r, lse_r = attention_ref(q, k_rep, v_rep, causal=True)
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-14)
    for h in range(6):
        out_h, lse_h = attention_ref(q[:, :, h : h + 1], k_rep[:, :, h : h + 1], v_rep[:, :, h : h + 1], causal=True)
        torch.testing.assert_close(out[:, :, h : h + 1], out_h, rtol=0, atol=1e-14)
        torch.testing.assert_close(lse[:, h : h + 1], lse_h, rtol=0, atol=1e-14)


@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (2, 1))])
def test_varlen_matches_per_sequence(causal, window):
    gen = torch.Generator().manual_seed(4)
    seqlens_q, seqlens_k = [5, 0, 7, 3, 1], [9, 4, 3, 0, 6]
    cu_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = _randn(gen, sum(seqlens_q), 4, 8)
    k = _randn(gen, sum(seqlens_k), 2, 8)
    v = _randn(gen, sum(seqlens_k), 2, 5)
    kw = dict(causal=causal, window_size=window, softcap=3.0)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert out.shape == (sum(seqlens_q), 4, 5) and lse.shape == (4, sum(seqlens_q))
    for b in range(len(seqlens_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out_b, lse_b = attention_ref(q[None, sq], k[None, sk], v[None, sk], **kw)
        torch.testing.assert_close(out[sq], out_b[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(lse[:, sq], lse_b[0], rtol=0, atol=1e-14)
    # Sequence 3 has no keys: O = 0 and LSE = -inf for its queries.
    rows = slice(cu_q[3], cu_q[4])
    assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isneginf(lse[:, rows]).all()


def _unused_rows(spans, used):
    """True for each row of the concatenated spans that lies past its sequence's seqused."""
    return torch.cat([torch.arange(span) >= u for span, u in zip(spans, used)])


@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (3, 1))])
def test_varlen_seqused_equals_the_sliced_problem(causal, window):
    """seqused keeps the first seqused[b] rows of each span: the same as packing only those
    (masks aligned to the used lengths); the other query rows get O = 0, LSE = -inf and every
    unused row a zero gradient."""
    gen = torch.Generator().manual_seed(11)
    spans_q, spans_k = [6, 4, 9, 3], [8, 5, 2, 7]
    used_q, used_k = [5, 0, 9, 2], [8, 3, 0, 4]
    cu = lambda n: torch.tensor([0] + n, dtype=torch.int32).cumsum(0).to(torch.int32)  # noqa: E731
    q = _randn(gen, sum(spans_q), 4, 8).requires_grad_()
    k = _randn(gen, sum(spans_k), 2, 8).requires_grad_()
    v = _randn(gen, sum(spans_k), 2, 5).requires_grad_()
    kw = dict(causal=causal, window_size=window)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu(spans_q), cu_seqlens_k=cu(spans_k),
                             seqused_q=torch.tensor(used_q, dtype=torch.int32),
                             seqused_k=torch.tensor(used_k, dtype=torch.int32), **kw)
    keep_q, keep_k = ~_unused_rows(spans_q, used_q), ~_unused_rows(spans_k, used_k)
    out_s, lse_s = attention_ref(q[keep_q], k[keep_k], v[keep_k], cu_seqlens_q=cu(used_q),
                                 cu_seqlens_k=cu(used_k), **kw)
    torch.testing.assert_close(out[keep_q], out_s, rtol=0, atol=0)
    torch.testing.assert_close(lse[:, keep_q], lse_s, rtol=0, atol=0)
    assert torch.equal(out[~keep_q], torch.zeros_like(out[~keep_q]))
    assert torch.isneginf(lse[:, ~keep_q]).all()
    (out * _randn(gen, *out.shape)).sum().backward()
    assert torch.equal(q.grad[~keep_q], torch.zeros_like(q.grad[~keep_q]))
    for t in (k, v):
        assert torch.equal(t.grad[~keep_k], torch.zeros_like(t.grad[~keep_k]))


@pytest.mark.parametrize("given", ["q", "k", "both"])
def test_padded_seqused_equals_per_batch_slices(given):
    gen = torch.Generator().manual_seed(12)
    q, k, v = _qkv(gen, 3, 7, 9, 4, 2, 8, 6)
    used_q = [7, 2, 0] if given != "k" else [7, 7, 7]
    used_k = [9, 1, 4] if given != "q" else [9, 9, 9]
    kw = {}
    if given != "k":
        kw["seqused_q"] = torch.tensor(used_q, dtype=torch.int32)
    if given != "q":
        kw["seqused_k"] = torch.tensor(used_k, dtype=torch.int32)
    out, lse = attention_ref(q, k, v, causal=True, **kw)
    assert out.shape == (3, 7, 4, 6) and lse.shape == (3, 4, 7)
    for b in range(3):
        uq, uk = used_q[b], used_k[b]
        out_b, lse_b = attention_ref(q[b:b + 1, :uq], k[b:b + 1, :uk], v[b:b + 1, :uk], causal=True)
        torch.testing.assert_close(out[b:b + 1, :uq], out_b, rtol=0, atol=0)
        torch.testing.assert_close(lse[b:b + 1, :, :uq], lse_b, rtol=0, atol=0)
        assert torch.equal(out[b, uq:], torch.zeros_like(out[b, uq:]))
        assert torch.isneginf(lse[b, :, uq:]).all()


def test_seqused_aligns_causal_to_the_used_lengths():
    """Query row i of a sequence with used lengths (uq, uk) sees keys j <= i + uk - uq."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = _qkv(gen, 1, 6, 10, 1, 1, 4, 4)
    out, _ = attention_ref(q, k, v, causal=True, seqused_q=torch.tensor([3], dtype=torch.int32),
                           seqused_k=torch.tensor([4], dtype=torch.int32))
    # Row 0 sees keys 0..1 only: the same output whatever keys 2.. hold.
    k2, v2 = k.clone(), v.clone()
    k2[:, 2:], v2[:, 2:] = 7.0, -3.0
    out2, _ = attention_ref(q, k2, v2, causal=True, seqused_q=torch.tensor([3], dtype=torch.int32),
                            seqused_k=torch.tensor([4], dtype=torch.int32))
    torch.testing.assert_close(out[:, 0], out2[:, 0], rtol=0, atol=0)
    assert not torch.equal(out[:, 2], out2[:, 2])


def test_bad_seqused_raise():
    q, k, v = torch.ones(2, 5, 2, 8), torch.ones(2, 4, 2, 8), torch.ones(2, 4, 2, 8)
    for kw in [dict(seqused_k=torch.tensor([5, 1], dtype=torch.int32)),  # past the span
               dict(seqused_q=torch.tensor([-1, 1], dtype=torch.int32)),
               dict(seqused_q=torch.tensor([1, 1, 1], dtype=torch.int32))]:  # wrong batch
        with pytest.raises(ValueError):
            attention_ref(q, k, v, **kw)


# --------------------------------------------------------------------------- gradients


def test_fully_masked_rows_zero_output_and_grads():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (t.requires_grad_() for t in _qkv(gen, 2, 9, 4, 2, 1, 8, 6))
    out, lse = attention_ref(q, k, v, causal=True, softcap=4.0)
    masked = slice(0, 5)  # rows i < seqlen_q - seqlen_k see nothing
    assert torch.equal(out[:, masked].detach(), torch.zeros(2, 5, 2, 6, dtype=torch.float64))
    assert torch.isneginf(lse[:, :, masked]).all() and torch.isfinite(lse[:, :, 5:]).all()
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    (out * _randn(gen, *out.shape)).sum().backward(retain_graph=True)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, masked], torch.zeros_like(q.grad[:, masked]))
    q.grad = None
    finite_lse.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, masked], torch.zeros_like(q.grad[:, masked]))


@pytest.mark.parametrize(
    "sq, sk, causal, window, softcap",
    [(3, 5, True, (None, None), 0.0), (5, 4, False, (1, 1), 1.5), (6, 3, True, (None, None), 0.0)],
)
def test_gradcheck_float64(sq, sk, causal, window, softcap):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (t.requires_grad_() for t in _qkv(gen, 1, sq, sk, 2, 1, 3, 2))

    def fn(q, k, v):
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap)
        # -inf LSE entries (fully masked rows) have no finite differences; drop them.
        return out, lse[torch.isfinite(lse)]

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- modes


def test_mode_dtypes_and_float32_accuracy():
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(gen, 1, 17, 23, 2, 2, 32, 32)
    out64, lse64 = attention_ref(q, k, v, causal=True)
    out32, lse32 = attention_ref(q.float(), k.float(), v.float(), causal=True, mode="float32")
    assert out32.dtype == lse32.dtype == torch.float32
    assert (out32.double() - out64).abs().max() < 1e-5
    with pytest.raises(ValueError):
        attention_ref(q, k, v, mode="float16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_mode_is_less_accurate_than_float32(dtype):
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(gen, 2, 33, 41, 4, 2, 64, 64, dtype=dtype)
    kw = dict(causal=True, softcap=10.0)
    out64, lse64 = attention_ref(q, k, v, **kw)
    out32, lse32 = attention_ref(q, k, v, mode="float32", **kw)
    outn, lsen = attention_ref(q, k, v, mode="native", **kw)
    assert outn.dtype == dtype and lsen.dtype == torch.float32
    err32 = (out32.double() - out64).abs().max()
    errn = (outn.double() - out64).abs().max()
    assert err32 < 1e-5 < errn < 0.05
    # LSE only sees the QK^T rounding: it must be in the input dtype, not float32.
    lse_err32 = (lse32.double() - lse64).abs().max()
    lse_errn = (lsen.double() - lse64).abs().max()
    assert 10 * lse_err32 < lse_errn < 0.1


@pytest.mark.parametrize("mode", ["float64", "float32", "native"])
def test_score_attention_ref_equals_attention_on_qk_scores(mode):
    gen = torch.Generator().manual_seed(10)
    dtype = torch.bfloat16 if mode == "native" else torch.float64
    q, k, v = _qkv(gen, 3, 13, 19, 1, 1, 16, 8, dtype=dtype)
    kw = dict(causal=True, window_size=(6, None), softcap=4.0)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, mode=mode, **kw)
    mm_dtype = dtype if mode != "float32" else torch.float32
    scores = torch.einsum("bqd,bkd->bqk", q[:, :, 0].to(mm_dtype), k[:, :, 0].to(mm_dtype))
    out_s, lse_s = score_attention_ref(scores, v[:, :, 0], 0.3, mode=mode, **kw)
    assert out_s.dtype == out.dtype and lse_s.dtype == lse.dtype
    torch.testing.assert_close(out_s, out[:, :, 0], rtol=0, atol=1e-12 if mode == "float64" else 1e-5)
    torch.testing.assert_close(lse_s, lse[:, 0], rtol=0, atol=1e-12 if mode == "float64" else 1e-5)
    with pytest.raises(ValueError):
        score_attention_ref(scores[:, :, :-1], v[:, :, 0], 0.3)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 4, 2, 8), (1, 5, 2, 8), (1, 6, 2, 8)),  # k / v seqlen differ
        ((1, 4, 3, 8), (1, 5, 2, 8), (1, 5, 2, 8)),  # nheads not a multiple of nheads_kv
        ((1, 4, 2, 8), (1, 5, 2, 16), (1, 5, 2, 8)),  # hdim differ
        ((2, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)),  # batch differ
        ((4, 2, 8), (5, 2, 8), (5, 2, 8)),  # 3-D without cu_seqlens
    ],
)
def test_bad_shapes_raise(shapes):
    q, k, v = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError):
        attention_ref(q, k, v)


def test_bad_cu_seqlens_raise():
    q, k, v = torch.ones(6, 2, 8), torch.ones(5, 2, 8), torch.ones(5, 2, 8)
    good_q, good_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32)
    attention_ref(q, k, v, cu_seqlens_q=good_q, cu_seqlens_k=good_k)
    for cu_q, cu_k in [
        (good_q, None),
        (torch.tensor([0, 2, 7], dtype=torch.int32), good_k),  # wrong total
        (torch.tensor([0, 4, 2, 6], dtype=torch.int32), torch.tensor([0, 1, 3, 5], dtype=torch.int32)),
        (good_q, torch.tensor([0, 1, 3, 5], dtype=torch.int32)),  # batch sizes differ
    ]:
        with pytest.raises(ValueError):
            attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# --------------------------------------------------------------------------- tolerance rule


def test_tolerance_check_pass_and_fail():
    gen = torch.Generator().manual_seed(9)
    ref = _randn(gen, 4, 16)
    native = ref + 1e-3 * _randn(gen, 4, 16)
    good = ref + 1e-3 * _randn(gen, 4, 16)
    res = tolerance_check(good.float(), ref, native)
    assert res.ok and res.err <= 2 * res.err_native + res.atol and 0 < res.atol < 1e-6
    bad = ref.clone()
    bad[2, 3] += 3 * (native - ref).abs().max()
    res = tolerance_check(bad, ref, native, atol=0.0)
    assert not res.ok and res.err > 2 * res.err_native
    assert tolerance_check(bad, ref, native, factor=4.0, atol=0.0).ok
    nan = good.clone()
    nan[0, 0] = math.nan
    assert not tolerance_check(nan, ref, native).ok
    with pytest.raises(ValueError):
        tolerance_check(good[:3], ref, native)


def test_tolerance_check_neg_inf_lse():
    ref = torch.tensor([-math.inf, 1.0, 2.0], dtype=torch.float64)
    native = torch.tensor([-math.inf, 1.01, 2.0])
    ok = tolerance_check(torch.tensor([-math.inf, 1.005, 2.0]), ref, native)
    assert ok.ok and ok.err == pytest.approx(0.005, rel=1e-4)
    # Finite where the reference is -inf, and -inf where it is finite, both fail.
    assert not tolerance_check(torch.tensor([0.0, 1.0, 2.0]), ref, native).ok
    assert not tolerance_check(torch.tensor([-math.inf, -math.inf, 2.0]), ref, native).ok
