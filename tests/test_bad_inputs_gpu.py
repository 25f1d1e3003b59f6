"""Issue 21's bad-input matrix on the GPU: every case is a clear error before any launch or,
for the contents of the index tensors with the content check off, a defined result; none may
touch memory outside the tensors (a fault would poison the CUDA context, and every later case
and test would fail with it)."""

import math

import pytest
import torch

import flash_cute
from flash_cute import flash_attn_func, flash_attn_varlen_func

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16


def _qkv(b=2, s=128, h=4, hk=4, d=64, dv=None, dtype=BF16, **kw):
    dv = d if dv is None else dv
    return (torch.randn(b, s, h, d, device="cuda", dtype=dtype, **kw),
            torch.randn(b, s, hk, d, device="cuda", dtype=dtype, **kw),
            torch.randn(b, s, hk, dv, device="cuda", dtype=dtype, **kw))


def _packed(total=256, h=4, d=64, grad=False):
    return tuple(torch.randn(total, h, d, device="cuda", dtype=BF16, requires_grad=grad)
                 for _ in range(3))


def _cu(*offsets, device="cuda", dtype=torch.int32):
    return torch.tensor(offsets, dtype=dtype, device=device)


def _misaligned(shape):
    buf = torch.empty(math.prod(shape) + 1, device="cuda", dtype=BF16)
    return buf[1:].view(shape)


def _noncontiguous_last():
    return torch.randn(2, 128, 4, 128, device="cuda", dtype=BF16)[..., ::2]


# (name, call, exception type, message pattern): refused before any launch.
REFUSED = [
    ("fp32", lambda: flash_attn_func(*_qkv(dtype=torch.float32)), TypeError, "bfloat16|float16"),
    ("mixed dtypes", lambda: flash_attn_func(*_qkv()[:2], _qkv(dtype=torch.float16)[2]),
     TypeError, "dtype"),
    ("int8", lambda: flash_attn_func(*(t.to(torch.int8) for t in _qkv())), TypeError, "dtype"),
    ("hdim 512", lambda: flash_attn_func(*_qkv(d=512)), NotImplementedError, "hdim"),
    ("hdim 60", lambda: flash_attn_func(*_qkv(d=60)), (ValueError, NotImplementedError),
     "hdim|multiple of 8"),
    ("hdim_v 512", lambda: flash_attn_func(*_qkv(dv=512)), NotImplementedError, "hdim"),
    ("heads not divisible", lambda: flash_attn_func(*_qkv(h=6, hk=4)), ValueError, "head"),
    ("q on the CPU", lambda: flash_attn_func(_qkv()[0].cpu(), *_qkv()[1:]), ValueError,
     "CUDA tensor"),
    ("k on the CPU", lambda: flash_attn_func(_qkv()[0], _qkv()[1].cpu(), _qkv()[2]),
     ValueError, "CUDA tensor"),
    ("cu_seqlens on the CPU", lambda: flash_attn_varlen_func(
        *_packed(), cu_seqlens_q=_cu(0, 128, 256, device="cpu"), cu_seqlens_k=_cu(0, 128, 256),
        max_seqlen_q=128, max_seqlen_k=128), ValueError,
     "CUDA tensor"),
    ("3-D q, padded API", lambda: flash_attn_func(*_packed()), ValueError, "4-D|dims"),
    ("batch mismatch", lambda: flash_attn_func(_qkv(b=2)[0], *_qkv(b=3)[1:]), ValueError,
     "batch"),
    ("k/v length mismatch", lambda: flash_attn_func(
        _qkv()[0], _qkv()[1], _qkv(s=64)[2]), ValueError, "seqlen|length"),
    ("q/k head-dim mismatch", lambda: flash_attn_func(_qkv(d=64)[0], *_qkv(d=128)[1:]),
     ValueError, "head dim|hdim"),
    ("cu_seqlens 2-D", lambda: flash_attn_varlen_func(
        *_packed(), cu_seqlens_q=_cu(0, 128, 256).view(1, 3), cu_seqlens_k=_cu(0, 128, 256),
        max_seqlen_q=128, max_seqlen_k=128), ValueError,
     "1-D|shape"),
    ("cu_seqlens of different batch", lambda: flash_attn_varlen_func(
        *_packed(), cu_seqlens_q=_cu(0, 128, 256), cu_seqlens_k=_cu(0, 256),
        max_seqlen_q=128, max_seqlen_k=256), ValueError, "batch"),
    ("non-contiguous last dim", lambda: flash_attn_func(*(_noncontiguous_last() for _ in "qkv")),
     ValueError, "last"),
    ("misaligned storage", lambda: flash_attn_func(_misaligned((2, 128, 4, 64)), *_qkv()[1:]),
     ValueError, "16-byte aligned"),
    ("negative softcap", lambda: flash_attn_func(*_qkv(), softcap=-1.0), ValueError, "softcap"),
    ("NaN softmax_scale", lambda: flash_attn_func(*_qkv(), softmax_scale=float("nan")),
     ValueError, "softmax_scale"),
    ("inf softmax_scale", lambda: flash_attn_func(*_qkv(), softmax_scale=float("inf")),
     ValueError, "softmax_scale"),
    ("cu_seqlens int64", lambda: flash_attn_varlen_func(
        *_packed(), cu_seqlens_q=_cu(0, 128, 256, dtype=torch.int64), cu_seqlens_k=_cu(0, 128, 256),
        max_seqlen_q=128, max_seqlen_k=128),
     TypeError, "int32"),
    ("unknown arch", lambda: flash_attn_func(*_qkv(), arch="volta"), NotImplementedError,
     "no such pipeline"),
]


@pytest.mark.parametrize("name,call,exc,match", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_input_is_refused_before_any_launch(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
    torch.cuda.synchronize()  # nothing was launched that could have faulted


def test_a_negative_window_is_unbounded_as_in_flash_attn():
    q, k, v = _qkv()
    out, _ = flash_attn_func(q, k, v, window_size=(-1, -1))
    ref, _ = flash_attn_func(q, k, v)
    assert torch.equal(out, ref)


# Index contents the host does not read (content check off): what they mean, as the clamped
# offsets of `flash_cute.blocks.seqlen` define it.
CONTENTS = [
    # cu_seqlens past the tensor: the second sequence ends at the tensor's last row.
    ("cu_seqlens past the tensor", (0, 128, 4096), 4096, None, (0, 128, 256), 128),
    # Decreasing: the second sequence starts where the first ends and is empty.
    ("decreasing cu_seqlens", (0, 200, 100), 200, None, (0, 200, 200), 200),
    # seqused past the span: clamped to the span.
    ("seqused past the span", (0, 128, 256), 128, (500, 7), (0, 128, 256), 128),
]


@pytest.mark.parametrize("name,cu,max_len,used_k,same_cu,same_max", CONTENTS,
                         ids=[c[0] for c in CONTENTS])
def test_bad_index_contents_give_the_defined_result(name, cu, max_len, used_k, same_cu, same_max):
    """Forward and backward run, in bounds, and equal the call with the clamped indices."""
    q, k, v = _packed(grad=True)
    dout = torch.randn_like(q)
    used = None if used_k is None else _cu(*used_k)
    used_same = None if used_k is None else _cu(min(used_k[0], 128), used_k[1])

    def run(cu_, max_, used_):
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu(*cu_), cu_seqlens_k=_cu(*cu_),
                                          max_seqlen_q=max_, max_seqlen_k=max_,
                                          seqused_k=used_, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return out, lse, grads

    out, lse, grads = run(cu, max_len, used)
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_grads = run(same_cu, same_max, used_same)
    rows = same_cu[-1]
    _close(out, ref_out)
    _close(lse[:, :rows], ref_lse[:, :rows])
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        _close(g, r)


def _close(x, ref):
    """Equal up to the rounding of a different tile order (the same math per row)."""
    x, ref = x.float(), ref.float()
    assert torch.equal(torch.isneginf(x), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert (x[finite] - ref[finite]).abs().max() <= 1e-2 * ref[finite].abs().max() + 1e-3


@pytest.mark.parametrize("deterministic", [False, True])
def test_max_seqlen_below_the_longest_sequence_leaves_its_excess_queries_out(deterministic):
    """The queries of a sequence past max_seqlen_q are left out, forward and backward: O = 0,
    LSE = -inf, dQ = 0, and they add nothing to dK/dV (what seqused_q would give them)."""
    q, k, v = _packed(grad=True)
    dout = torch.randn_like(q)
    cu = _cu(0, 100, 256)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=100, max_seqlen_k=156, return_lse=True,
                                      deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    used = _cu(100, 100)
    ref, ref_lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=100, max_seqlen_k=156, seqused_q=used,
                                          return_lse=True, deterministic=deterministic)
    rdq, rdk, rdv = torch.autograd.grad(ref, (q, k, v), dout)
    assert (out[200:] == 0).all() and torch.isneginf(lse[:, 200:]).all() and (dq[200:] == 0).all()
    for g, r in ((out, ref), (lse, ref_lse), (dq, rdq), (dk, rdk), (dv, rdv)):
        _close(g, r)


CHECKED = [
    ((0, 128, 4096), 4096, None, r"cu_seqlens_q\[-1\]=4096 exceeds"),
    ((0, 200, 100), 200, None, "non-decreasing"),
    ((0, 100, 256), 100, None, "max_seqlen_q=100 is smaller than the longest"),
    ((0, 128, 256), 128, (500, 7), r"seqused_k\[0\]=500 must be in \[0, 128\]"),
]


@pytest.mark.parametrize("cu,max_len,used_k,match", CHECKED)
def test_the_content_check_refuses_the_four_cases(cu, max_len, used_k, match):
    q, k, v = _packed()
    used = None if used_k is None else _cu(*used_k)
    previous = flash_cute.check_inputs(True)
    try:
        # A good call of the same shapes first: the plan cache must not skip the check.
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu(0, 128, 256), cu_seqlens_k=_cu(0, 128, 256),
                               max_seqlen_q=128, max_seqlen_k=128,
                               seqused_k=None if used is None else _cu(7, 7))
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu(*cu), cu_seqlens_k=_cu(*cu),
                                   max_seqlen_q=max_len, max_seqlen_k=max_len,
                                   seqused_k=used)
    finally:
        flash_cute.check_inputs(previous)
