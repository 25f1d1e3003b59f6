"""CPU tests of flash_cute.reference.block_models: the block-level models the CuTe DSL kernels mirror."""

import math

import pytest
import torch

from flash_cute.contract.block_range import BlockRange, block_runs
from flash_cute.reference.attention import attention_mask, attention_ref
from flash_cute.reference.block_models import (
    EXP2_POLY_COEFFS,
    EXP2_POLY_MAX_REL_ERR,
    OnlineSoftmax,
    block_range,
    exp2_poly,
    lse_merge,
    tiled_attention_forward,
)

LOG2_E = math.log2(math.e)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# --------------------------------------------------------------------------- online softmax


@pytest.mark.parametrize(
    "blocks, first_state",
    [
        # Split [1, 3] | [2]: after block 1, m = 3, l = e^-2 + 1, acc = 10 e^-2 + 20.
        ([([1.0, 3.0], [10.0, 20.0]), ([2.0], [30.0])], (3.0, 1.1353, 21.353)),
        # Split [1, 2] | [3] (keys reordered): after block 1, m = 2, l = e^-1 + 1, acc = 10 e^-1 + 30.
        ([([1.0, 2.0], [10.0, 30.0]), ([3.0], [20.0])], (2.0, 1.3679, 33.679)),
    ],
)
def test_seed_worked_example(blocks, first_state):
    state = OnlineSoftmax(rows=1, hdim_v=1, scale=1.0)
    assert state.scale_log2 == pytest.approx(LOG2_E)
    for idx, (scores, values) in enumerate(blocks):
        state.update(torch.tensor([scores], dtype=torch.float64), torch.tensor(values, dtype=torch.float64)[:, None])
        if idx == 0:
            m, l, acc = first_state
            assert state.m.item() == m * LOG2_E
            assert state.l.item() == pytest.approx(l, abs=1e-4)
            assert state.acc.item() == pytest.approx(acc, abs=1e-3)
    out, lse = state.finalize()
    assert out.item() == pytest.approx(21.547, abs=1e-3)
    assert lse.item() == pytest.approx(3.4076, abs=1e-4)
    assert state.l.item() == pytest.approx(math.exp(-2) + 1 + math.exp(-1), rel=1e-14)


@pytest.mark.parametrize("seed", range(3))
def test_online_softmax_matches_dense_softmax_any_split(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, n, scale = 7, 29, 0.3
    scores, v = 4 * _randn(gen, rows, n), _randn(gen, n, 5)
    perm = torch.randperm(n, generator=gen)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[:4].add(1).tolist())
    state = OnlineSoftmax(rows, 5, scale)
    for cols in torch.tensor_split(perm, cuts):
        p = state.update(scores[:, cols], v[cols])
        assert p.shape == (rows, len(cols)) and (p <= 1).all()
    out, lse = state.finalize()
    torch.testing.assert_close(out, torch.softmax(scores * scale, dim=1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores * scale, dim=1), rtol=1e-12, atol=1e-12)


def test_a_max_that_stays_put_rescales_by_exactly_one():
    """float32 with the kernel's FFMA exponent, scores near 8,000 (a large score mod's), the
    max in the first of 200 blocks: the LSE stays within a few float32 roundings of float64.
    A rescale of exp2(m * scale_log2 - M), the exact product less the rounded M, would
    multiply l by the same rounding error at each block, up to 0.1 in the LSE here."""
    gen = torch.Generator().manual_seed(5)
    scores = 8000 + _randn(gen, 4, 200 * 64).float()
    scores[:, 3] += 20
    v = _randn(gen, 200 * 64, 2).float()
    state = OnlineSoftmax(4, 2, 1.0, torch.float32, fma=True)
    for block in range(200):
        state.update(scores[:, block * 64:(block + 1) * 64], v[block * 64:(block + 1) * 64])
    _, lse = state.finalize()
    lse64 = torch.logsumexp(scores.double(), dim=1)
    assert (lse.double() - lse64).abs().max() < 4 * 2.0 ** -11   # float32's ulp at 4096-8192


def test_online_softmax_masked_rows_and_blocks():
    gen = torch.Generator().manual_seed(3)
    scores, v = _randn(gen, 3, 8), _randn(gen, 8, 2)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[0] = False  # row 0 never sees a key
    mask[1, :4] = False  # row 1's first block is fully masked
    masked = scores.masked_fill(~mask, -math.inf)
    state = OnlineSoftmax(3, 2, scale=0.5)
    state.update(masked[:, :4], v[:4])
    assert torch.isneginf(state.m[:2]).all() and torch.equal(state.l[:2], torch.zeros(2, dtype=torch.float64))
    state.update(masked[:, 4:], v[4:])
    out, lse = state.finalize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0], torch.zeros(2, dtype=torch.float64)) and torch.isneginf(lse[0])
    torch.testing.assert_close(out[1:], torch.softmax(masked[1:] * 0.5, dim=1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[1:], torch.logsumexp(masked[1:] * 0.5, dim=1), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- block_range


def _visible_padded(sq, sk, bn, causal, window):
    """Visibility mask with key columns padded to whole blocks (padding invisible)."""
    n_blocks = -(-sk // bn)
    mask = torch.zeros(sq, n_blocks * bn, dtype=torch.bool)
    mask[:, :sk] = attention_mask(sq, sk, causal, window)
    return mask


def _check_block_range(bm, bn, sq, sk, causal, left, right, pack=1):
    """Against the mask; `pack` > 1: rows of `pack` heads interleaved (packed GQA)."""
    mask = _visible_padded(sq, sk, bn, causal, (left, right)).repeat_interleave(pack, dim=0)
    n_blocks = mask.shape[1] // bn
    for m_block in range(-(-sq * pack // bm)):
        rows = mask[m_block * bm : (m_block + 1) * bm]  # in-bounds rows only
        n_min, n_max, nm_min, nm_max = block_range(m_block, bm, bn, sq, sk, causal, left, right,
                                                   pack)
        case = (bm, bn, sq, sk, causal, left, right, pack, m_block,
               (n_min, n_max, nm_min, nm_max))
        assert 0 <= n_min <= n_blocks and 0 <= n_max <= n_blocks, case
        any_visible = [bool(rows[:, n * bn : (n + 1) * bn].any()) for n in range(n_blocks)]
        all_visible = [bool(rows[:, n * bn : (n + 1) * bn].all()) for n in range(n_blocks)]
        visited = range(n_min, max(n_min, n_max))
        # Complete: every block holding a visible entry is visited.
        assert all(n in visited for n in range(n_blocks) if any_visible[n]), case
        # Tight: the range ends hold visible entries; empty exactly when nothing is visible.
        if visited:
            assert any_visible[n_min] and any_visible[n_max - 1], case
        else:
            assert not any(any_visible), case
        # No-mask range: a sub-range, and exactly the visited blocks needing no mask.
        assert n_min <= nm_min <= nm_max <= max(n_min, n_max), case
        for n in visited:
            assert (nm_min <= n < nm_max) == all_visible[n], case
        if visited:
            _check_block_runs(block_runs(BlockRange(n_min, n_max, nm_min, nm_max)), n_min,
                              all_visible, causal or left is not None or right is not None, case)


def _check_block_runs(runs, n_min, all_visible, windowed, case):
    """`block_runs`: the blocks after the first in three ordered runs, masked where they
    need it, and no masked run without a window (the forward then runs them unmasked)."""
    end, unmasked_end, unmasked_begin = runs
    assert n_min <= unmasked_begin <= unmasked_end <= end, (case, runs)
    for n in range(n_min, end):
        assert all_visible[n] == (unmasked_begin <= n < unmasked_end), (case, runs, n)
    if not windowed:
        assert unmasked_begin == n_min and unmasked_end == end, (case, runs)


def test_block_range_hand_examples():
    # Causal square 8x8 with 4x4 tiles: block 0 is the masked diagonal only;
    # block 1 sees key block 0 unmasked and its diagonal masked.
    assert block_range(0, 4, 4, 8, 8, True, None, None) == (0, 1, 0, 0)
    assert block_range(1, 4, 4, 8, 8, True, None, None) == (0, 2, 0, 1)
    # seqlen_q > seqlen_k causal: rows 0-3 of 8 queries see none of 4 keys.
    n_min, n_max, _, _ = block_range(0, 4, 4, 8, 4, True, None, None)
    assert n_max <= n_min
    # Non-causal, partial last key block (sk = 10, bn = 4): 3 blocks, last needs the bounds mask.
    assert block_range(0, 4, 4, 5, 10, False, None, None) == (0, 3, 0, 2)
    # Window (0, 0) with 8 queries, 5 keys: row i sees key i - 3 only, so rows 0-3
    # visit key block 0 (masked) and rows 4-7 keys 1-4 across blocks 0 and 1.
    assert block_range(0, 4, 4, 8, 5, False, 0, 0) == (0, 1, 0, 0)
    n_min, n_max, nm_min, nm_max = block_range(1, 4, 4, 8, 5, False, 0, 0)
    assert (n_min, n_max) == (0, 2) and nm_min == nm_max  # no block is mask-free


@pytest.mark.parametrize("seed", range(4))
def test_block_range_bruteforce(seed):
    gen = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for _ in range(120):
        bm, bn = randint(1, 6), randint(1, 6)
        sq, sk = randint(1, 17), randint(1, 17)
        causal = bool(randint(0, 1))
        left = None if randint(0, 2) == 0 else randint(0, 8)
        right = None if randint(0, 2) == 0 else randint(0, 8)
        _check_block_range(bm, bn, sq, sk, causal, left, right)
        pack = randint(2, 4)
        _check_block_range(pack * randint(1, 3), bn, sq, sk, causal, left, right, pack)


def test_block_range_edge_configs():
    for bm, bn in [(1, 1), (3, 5), (8, 8), (16, 4)]:
        for sq, sk in [(1, 1), (1, 9), (9, 1), (13, 7), (7, 13), (16, 16)]:
            for causal, left, right in [(True, None, None), (False, 0, 0), (False, 2, None), (True, 3, None)]:
                _check_block_range(bm, bn, sq, sk, causal, left, right)


class _StrictInt:
    """An int that supports only what a DSL runtime integer is promised: + - * and
    // on non-negative operands (C truncation and Python floor then agree)."""

    def __init__(self, value):
        self.value = int(value)

    @staticmethod
    def _v(x):
        assert isinstance(x, (_StrictInt, int)) and not isinstance(x, bool), type(x)
        return x.value if isinstance(x, _StrictInt) else x

    def __add__(self, o):
        return _StrictInt(self.value + self._v(o))

    def __sub__(self, o):
        return _StrictInt(self.value - self._v(o))

    def __mul__(self, o):
        return _StrictInt(self.value * self._v(o))

    def __floordiv__(self, o):
        assert self.value >= 0 and self._v(o) > 0, "division of a negative operand"
        return _StrictInt(self.value // self._v(o))


def test_block_range_is_integer_only_with_injected_min_max():
    calls = []

    def imin(a, b):
        calls.append("min")
        return _StrictInt(min(_StrictInt._v(a), _StrictInt._v(b)))

    def imax(a, b):
        calls.append("max")
        return _StrictInt(max(_StrictInt._v(a), _StrictInt._v(b)))

    for args in [(0, 4, 4, 8, 4, True, None, None), (2, 3, 5, 13, 7, False, 2, 1), (1, 4, 3, 9, 20, True, 5, None)]:
        m_block, bm, bn, sq, sk, causal, left, right = args
        wrap = [_StrictInt(x) for x in (m_block, bm, bn, sq, sk)]
        strict_left, strict_right = (None if w is None else _StrictInt(w) for w in (left, right))
        got = block_range(*wrap, causal, strict_left, strict_right, imin=imin, imax=imax)
        assert tuple(x.value for x in got) == block_range(*args)
    assert "min" in calls and "max" in calls


# --------------------------------------------------------------------------- tiled forward


def _rand_order(seed):
    gen = torch.Generator().manual_seed(seed)
    return lambda blocks: [blocks[i] for i in torch.randperm(len(blocks), generator=gen)]


@pytest.mark.parametrize(
    "bm, bn, sq, sk, h, h_kv, causal, window, softcap, order",
    [
        (4, 4, 16, 16, 2, 2, False, (None, None), 0.0, "ascending"),
        (5, 3, 13, 17, 2, 1, True, (None, None), 0.0, "descending"),
        (3, 7, 17, 11, 4, 2, True, (None, None), 0.0, "ascending"),
        (8, 5, 19, 23, 2, 2, False, (4, 3), 0.0, "descending"),
        (6, 4, 21, 9, 3, 1, True, (5, None), 0.0, "random"),
        (7, 6, 11, 29, 2, 2, False, (None, 2), 7.5, "random"),
        (1, 1, 5, 7, 1, 1, True, (1, None), 3.0, "descending"),
        (32, 32, 9, 13, 2, 1, False, (None, None), 0.0, "ascending"),
        (4, 16, 15, 15, 2, 2, True, (None, None), 2.0, "random"),
        (2, 9, 10, 31, 6, 3, False, (0, 0), 0.0, "descending"),
    ],
)
def test_tiled_matches_reference(bm, bn, sq, sk, h, h_kv, causal, window, softcap, order):
    gen = torch.Generator().manual_seed(bm * 1000 + bn * 100 + sq)
    q, k, v = _randn(gen, 2, sq, h, 8), _randn(gen, 2, sk, h_kv, 8), _randn(gen, 2, sk, h_kv, 6)
    kw = dict(softmax_scale=0.4, causal=causal, window_size=window, softcap=softcap)
    order = _rand_order(sq) if order == "random" else order
    out, lse = tiled_attention_forward(q, k, v, block_m=bm, block_n=bn, order=order, **kw)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "bm, bn, sq, sk, h, h_kv, causal, window, softcap",
    [
        (8, 4, 13, 17, 8, 2, True, (None, None), 0.0),
        (6, 5, 11, 23, 6, 2, False, (4, 2), 0.0),
        (4, 3, 9, 7, 4, 1, True, (3, None), 2.5),
        (16, 8, 5, 19, 8, 1, False, (None, 0), 0.0),
    ],
)
def test_tiled_packed_gqa_matches_reference(bm, bn, sq, sk, h, h_kv, causal, window, softcap):
    """Packed GQA tiles (rows of a K/V head's query heads interleaved) give the reference."""
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = _randn(gen, 2, sq, h, 8), _randn(gen, 2, sk, h_kv, 8), _randn(gen, 2, sk, h_kv, 6)
    kw = dict(softmax_scale=0.4, causal=causal, window_size=window, softcap=softcap)
    out, lse = tiled_attention_forward(q, k, v, block_m=bm, block_n=bn, pack_gqa=True, **kw)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=0, atol=1e-10)


def test_tiled_fully_masked_and_empty_keys():
    gen = torch.Generator().manual_seed(11)
    q, k, v = _randn(gen, 1, 11, 2, 4), _randn(gen, 1, 3, 2, 4), _randn(gen, 1, 3, 2, 4)
    out, lse = tiled_attention_forward(q, k, v, block_m=4, block_n=2, causal=True)
    assert torch.equal(out[0, :8], torch.zeros(8, 2, 4, dtype=torch.float64))
    assert torch.isneginf(lse[0, :, :8]).all() and torch.isfinite(lse[0, :, 8:]).all()
    out, lse = tiled_attention_forward(q, k[:, :0], v[:, :0], block_m=4, block_n=2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_tiled_rejects_bad_order_and_shapes():
    gen = torch.Generator().manual_seed(12)
    q, k, v = _randn(gen, 1, 6, 2, 4), _randn(gen, 1, 9, 2, 4), _randn(gen, 1, 9, 2, 4)
    with pytest.raises(ValueError):
        tiled_attention_forward(q, k, v, block_m=4, block_n=4, order=lambda blocks: blocks[:-1])
    with pytest.raises(ValueError):
        tiled_attention_forward(q, k, v, block_m=4, block_n=4, order="sideways")
    with pytest.raises(ValueError):
        tiled_attention_forward(q, k[:, :, :1].expand(-1, -1, 3, -1), v, block_m=4, block_n=4)


def test_tiled_float32_close_to_reference():
    gen = torch.Generator().manual_seed(13)
    q, k, v = _randn(gen, 1, 37, 2, 32), _randn(gen, 1, 45, 2, 32), _randn(gen, 1, 45, 2, 16)
    out, lse = tiled_attention_forward(q, k, v, block_m=16, block_n=8, causal=True, dtype=torch.float32)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    assert out.dtype == torch.float32
    assert (out.double() - out_ref).abs().max() < 1e-5 and (lse.double() - lse_ref).abs().max() < 1e-5


# --------------------------------------------------------------------------- LSE merge


def _partial(scores, mask, v, cols, scale):
    """Attention of every row over key subset ``cols`` via the online-softmax model."""
    state = OnlineSoftmax(scores.shape[0], v.shape[1], scale)
    state.update(scores[:, cols].masked_fill(~mask[:, cols], -math.inf), v[cols])
    return state.finalize()


@pytest.mark.parametrize("splits", [[6], [3, 7, 12], [1]])
def test_lse_merge_parts_equal_whole(splits):
    gen = torch.Generator().manual_seed(len(splits))
    sq, sk, scale = 9, 15, 0.35
    q, k, v = _randn(gen, 1, sq, 1, 8), _randn(gen, 1, sk, 1, 8), _randn(gen, 1, sk, 1, 5)
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=scale, causal=True, window_size=(5, None))
    mask = attention_mask(sq, sk, True, (5, None))
    scores = q[0, :, 0] @ k[0, :, 0].T
    parts = [_partial(scores, mask, v[0, :, 0], cols, scale) for cols in torch.tensor_split(torch.arange(sk), splits)]
    lse_parts = torch.stack([p[1] for p in parts])
    assert torch.isneginf(lse_parts).any(), "some row must be fully masked in some part"
    out, lse = lse_merge(torch.stack([p[0] for p in parts]), lse_parts)
    torch.testing.assert_close(out, out_ref[0, :, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref[0, 0], rtol=0, atol=1e-12)


def test_lse_merge_with_empty_and_all_empty_parts():
    gen = torch.Generator().manual_seed(21)
    o, lse = _randn(gen, 3, 4, 5), _randn(gen, 3, 4)
    junk = 1e3 * _randn(gen, 3, 4, 5)  # an empty part's O must not matter
    neg_inf = torch.full((3, 4), -math.inf, dtype=torch.float64)
    out, lse_m = lse_merge(torch.stack([junk, o]), torch.stack([neg_inf, lse]))
    torch.testing.assert_close(out, o, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse_m, lse, rtol=0, atol=1e-14)
    out, lse_m = lse_merge(torch.stack([junk, junk]), torch.stack([neg_inf, neg_inf]))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse_m).all()
    with pytest.raises(ValueError):
        lse_merge(o[None], lse[None, :2])


def test_lse_merge_is_stable_for_large_lse():
    # exp(800) overflows float64; the merge must shift by the max first.
    o = torch.tensor([[[1.0]], [[3.0]]], dtype=torch.float64)
    lse = torch.tensor([[800.0], [800.0 + math.log(3)]], dtype=torch.float64)
    out, lse_m = lse_merge(o, lse)
    assert out.item() == pytest.approx(0.25 * 1 + 0.75 * 3, rel=1e-14)
    assert lse_m.item() == pytest.approx(800 + math.log(4), rel=1e-14)


# --------------------------------------------------------------------------- exp2_poly


@pytest.mark.parametrize("degree", sorted(EXP2_POLY_COEFFS))
def test_exp2_poly_relative_error_bound(degree):
    x = torch.linspace(-126, 127, 400_001, dtype=torch.float32)
    gen = torch.Generator().manual_seed(degree)
    x = torch.cat([x, torch.rand(100_000, generator=gen) * 253 - 126])
    exact = torch.exp2(x.double())
    rel = ((exp2_poly(x, degree).double() - exact) / exact).abs().max().item()
    assert rel <= EXP2_POLY_MAX_REL_ERR[degree]
    assert rel > EXP2_POLY_MAX_REL_ERR[degree] / 2, "documented bound should be close to the measured error"


def test_exp2_poly_degree3_good_enough_for_bf16():
    assert EXP2_POLY_MAX_REL_ERR[3] < 2.0**-8 / 4  # well below bf16 half-ulp


@pytest.mark.parametrize("degree", sorted(EXP2_POLY_COEFFS))
def test_exp2_poly_exact_at_integers_and_pinned(degree):
    j = torch.arange(-126, 128, dtype=torch.float32)
    assert torch.equal(exp2_poly(j, degree), torch.exp2(j))
    # p(1) = 2 exactly in float32 Horner form, so the pieces meet at integers.
    f = torch.tensor(1.0)
    poly = torch.tensor(0.0)
    for c in reversed(EXP2_POLY_COEFFS[degree]):
        poly = poly * f + c
    assert (poly * f + 1.0).item() == 2.0
    below = torch.nextafter(j, j - 1)
    assert (exp2_poly(below, degree) <= exp2_poly(j, degree)).all()


def test_exp2_poly_clamp_and_underflow():
    x = torch.tensor([-math.inf, -1000.0, -127.0, -150.0])
    assert torch.equal(exp2_poly(x), torch.zeros(4))
    # [-127, -126): denormal bit patterns; only the absolute error is meaningful.
    x = torch.linspace(-127, -126, 1001)
    assert (exp2_poly(x).double() - torch.exp2(x.double())).abs().max() < 2.0**-126
    assert exp2_poly(torch.tensor([-126.0], dtype=torch.float64)).dtype == torch.float32
    with pytest.raises(ValueError):
        exp2_poly(x, degree=2)


def test_exp2_poly_as_softmax_exp():
    # Softmax probabilities computed with the software exp2 stay within bf16 precision.
    gen = torch.Generator().manual_seed(31)
    s = 5 * torch.randn(64, 127, generator=gen)
    x = (s - s.amax(dim=1, keepdim=True)) * LOG2_E
    p = exp2_poly(x)
    p_exact = torch.exp2(x.double())
    assert ((p.double() - p_exact).abs() / p_exact.clamp(min=1e-30)).max() < 2.0**-9


def test_m_block_range_is_tight_against_the_mask():
    """Brute force: the query blocks that see a key block are exactly [m_min, m_max)."""
    import random

    from flash_cute.contract.block_range import m_block_range
    from flash_cute.reference.attention import attention_mask

    rng = random.Random(7)
    for _ in range(400):
        sq, sk = rng.randint(1, 300), rng.randint(1, 300)
        tm, tn = rng.choice([16, 64, 128]), rng.choice([32, 64, 128])
        causal = rng.random() < 0.4
        left = rng.choice([None, 0, 5, 77, 300])
        right = None if causal else rng.choice([None, 0, 9, 150])
        visible = attention_mask(sq, sk, causal, (left, right))
        for n in range(-(-sk // tn)):
            cols = visible[:, n * tn:(n + 1) * tn].any(dim=1)
            seen = {i // tm for i in range(sq) if cols[i]}
            m_min, m_max = m_block_range(n, tm, tn, sq, sk, causal, left, right)
            case = (sq, sk, tm, tn, causal, left, right, n)
            if seen:
                assert (m_min, m_max) == (min(seen), max(seen) + 1), case
                assert seen == set(range(m_min, m_max)), case
            else:
                assert m_max <= m_min, case
