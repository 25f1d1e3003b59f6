"""The Hopper backward main kernel (`arch.hopper.bwd_api.backward`) against float64 autograd.

Not yet behind the dispatcher (autograd still runs the Ampere backward on sm90), so these tests
call the host entry directly on the (O, LSE) of the Hopper forward and compare dQ, dK, dV with
the FlashAttention rule (`tolerance_check`: error <= 2x a bf16/fp16 PyTorch implementation's,
plus rounding atol). Needs an H100/H200.
"""

import math

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, tolerance_check
from flash_cute.validation import validate_attention_inputs, validate_backward_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper backward needs an sm90 GPU")


def _inputs(batch, sq, sk, h, hk, d, dv, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(batch, sq, h, d), make(batch, sk, hk, d), make(batch, sk, hk, dv), \
        make(batch, sq, h, dv)


def _hopper_grads(q, k, v, dout, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, dlse=None, **kw):
    """Hopper forward (O, LSE), then the Hopper backward on them."""
    from flash_cute.arch.hopper.bwd_api import backward

    varlen = cu_seqlens_q is not None
    window = kw.get("window_size", (None, None))
    problem = validate_attention_inputs(
        q, k, v, softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
        window_size=window, softcap=kw.get("softcap", 0.0), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if varlen:
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, return_lse=True, arch="hopper", **kw)
    else:
        out, lse = flash_attn_func(q, k, v, return_lse=True, arch="hopper", **kw)
    validate_backward_inputs(dout, q, k, v, out, lse, problem)
    return backward(dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q, cu_seqlens_k)


def _ref_grads(mode, q, k, v, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention_ref(*leaves, mode=mode, **kw)[0]
    return torch.autograd.grad(out, leaves, dout)


def _check(ours, q, k, v, dout, **kw):
    ref = _ref_grads("float64", q.double(), k.double(), v.double(), dout.double(), **kw)
    nat = _ref_grads("native", q, k, v, dout, **kw)
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        assert g.shape == g_ref.shape and g.dtype == q.dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"


# (hdim, hdim_v, causal, window, softcap, dtype): each line is one compiled kernel.
KERNELS = [
    (64, 64, False, (None, None), 0.0, torch.bfloat16),
    (64, 64, True, (None, None), 0.0, torch.float16),
    (96, 96, False, (None, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 0.0, torch.bfloat16),
    (128, 128, True, (None, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 0.0, torch.float16),
    (192, 192, False, (None, None), 0.0, torch.bfloat16),
    (192, 128, True, (None, None), 0.0, torch.bfloat16),
    (256, 256, False, (None, None), 0.0, torch.bfloat16),
    (256, 256, True, (None, None), 0.0, torch.bfloat16),
    (64, 64, False, (97, 33), 0.0, torch.bfloat16),
    (128, 128, True, (200, None), 0.0, torch.bfloat16),
    (128, 128, False, (None, None), 15.0, torch.bfloat16),
    (128, 128, False, (61, 40), 15.0, torch.bfloat16),
    (64, 64, True, (None, None), 30.0, torch.float16),
]
SHAPES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 113, 203, 4, 4),
    (1, 300, 130, 8, 1),  # MQA; causal: the first 170 rows see no key
    (2, 257, 129, 6, 2),  # GQA 3:1, several query tiles and a partial last one
    (3, 1, 1, 2, 2),
]


@pytest.mark.parametrize("hdim,hdim_v,causal,window,softcap,dtype", KERNELS)
@pytest.mark.parametrize("batch,sq,sk,h,hk", SHAPES)
def test_hopper_backward_matches_float64(hdim, hdim_v, causal, window, softcap, dtype, batch, sq,
                                         sk, h, hk):
    q, k, v, dout = _inputs(batch, sq, sk, h, hk, hdim, hdim_v, dtype, seed=sq * 5 + hdim)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    _check(_hopper_grads(q, k, v, dout, **kw), q, k, v, dout, **kw)


def test_hopper_backward_long_gqa_8_to_1_with_scale():
    q, k, v, dout = _inputs(2, 1031, 2047, 16, 2, 128, 128, torch.bfloat16, seed=11)
    kw = dict(causal=True, softmax_scale=0.07)
    _check(_hopper_grads(q, k, v, dout, **kw), q, k, v, dout, **kw)


def test_hopper_backward_through_lse():
    """A loss that uses the LSE too: dS = P (dP - (Δ - dLSE))."""
    from flash_cute.arch.hopper.bwd_api import backward

    q, k, v, dout = _inputs(2, 157, 211, 4, 2, 64, 64, torch.bfloat16, seed=12)
    dlse = torch.randn(2, 4, 157, device="cuda")
    problem = validate_attention_inputs(q, k, v, causal=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, arch="hopper")
    ours = backward(dout, dlse, q, k, v, out, lse, problem)

    def loss_grads(mode, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        o, l = attention_ref(*leaves, causal=True, mode=mode)
        loss = (o.double() * dout.double()).sum() + (l.double() * dlse.double()).sum()
        return torch.autograd.grad(loss, leaves)

    ref = loss_grads("float64", (q.double(), k.double(), v.double()))
    nat = loss_grads("native", (q, k, v))
    for name, g, g_ref, g_nat in zip(("dQ", "dK", "dV"), ours, ref, nat):
        res = tolerance_check(g, g_ref, g_nat)
        assert res.ok, f"{name}: err {res.err:.3e} vs native {res.err_native:.3e}"


@pytest.mark.parametrize("causal,hdim", [(True, 128), (False, 64)])
def test_hopper_backward_varlen_with_empty_sequence(causal, hdim):
    seqlens_q, seqlens_k = [37, 0, 129, 1, 300], [50, 17, 0, 1, 257]
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(13)
    make = lambda n, h: torch.randn(n, h, hdim, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v = make(sum(seqlens_q), 6), make(sum(seqlens_k), 2), make(sum(seqlens_k), 2)
    dout = make(sum(seqlens_q), 6)
    ours = _hopper_grads(q, k, v, dout, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)
    _check(ours, q, k, v, dout, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # Keys of the sequence with no query (rows 50..66) get exactly zero gradient.
    assert (ours[1][50:67] == 0).all() and (ours[2][50:67] == 0).all()


def test_hopper_backward_every_gradient_element_is_written(monkeypatch):
    """Poison torch.empty with NaN: a dK/dV row the kernel skips would stay NaN."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    q, k, v, dout = _inputs(2, 333, 251, 4, 4, 128, 128, torch.bfloat16, seed=4)
    problem = validate_attention_inputs(q, k, v, window_size=(20, 0))
    out, lse = flash_attn_func(q, k, v, window_size=(20, 0), return_lse=True, arch="hopper")
    from flash_cute.arch.hopper.bwd_api import backward

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    grads = backward(dout, None, q, k, v, out, lse, problem)
    monkeypatch.undo()
    assert all(not torch.isnan(g).any() for g in grads)
    _check(grads, q, k, v, dout, window_size=(20, 0))


def test_hopper_backward_new_lengths_reuse_the_compiled_kernel():
    from flash_cute.jit import compile_cache

    q, k, v, dout = _inputs(1, 100, 100, 2, 2, 64, 64, torch.bfloat16, seed=5)
    _hopper_grads(q, k, v, dout)
    before = len(compile_cache)
    for sq, sk, b in [(777, 555, 3), (64, 1000, 1)]:
        q, k, v, dout = _inputs(b, sq, sk, 2, 2, 64, 64, torch.bfloat16, seed=sq)
        _check(_hopper_grads(q, k, v, dout), q, k, v, dout)
    assert len(compile_cache) == before


def test_dispatcher_still_uses_the_ampere_backward_on_sm90():
    """Until this kernel is validated, autograd on sm90 must not pick it up."""
    from flash_cute.interface import select_backward_pipeline

    assert select_backward_pipeline(torch.device("cuda"), "hopper") == "ampere"
