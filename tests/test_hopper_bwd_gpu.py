"""The Hopper backward's own cases, calling `arch.hopper.api.backward` directly on the (O, LSE)
of the Hopper forward, against float64 autograd by the FlashAttention rule (`tolerance_check`:
error <= 2x a bf16/fp16 PyTorch implementation's, plus rounding atol). The feature matrix runs
through autograd in tests/test_attention_gpu.py; deterministic=True (bitwise-reproducible dQ)
is checked here through autograd too. Needs an H100/H200.
"""

import math

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.attention import attention_ref, tolerance_check
from flash_cute.runtime.problem import validate_attention_inputs, validate_backward_inputs

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
    from flash_cute.arch.hopper.planner import backward

    varlen = cu_seqlens_q is not None
    window = kw.get("window_size", (None, None))
    problem = validate_attention_inputs(
        q, k, v, softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
        window_size=window, softcap=kw.get("softcap", 0.0), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if varlen:
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                          max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k, return_lse=True, arch="hopper", **kw)
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


@pytest.mark.parametrize("hdim,causal", [(128, True), (64, False)])
def test_hopper_varlen_backward_ignores_nan_past_the_sequences(hdim, causal):
    """Rows of the packed tensors past cu_seqlens[-1] hold NaN/inf (q, k, v, dout): TMA loads
    them into the last tiles, and the kernels must zero them before any GEMM multiplies a
    probability of 0 by them. Gradients of the used rows pass the float64 rule; those of the
    unused rows are exactly 0."""
    seqlens_q, seqlens_k = [45, 130, 77], [61, 99, 130]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(seqlens_q), cu(seqlens_k)
    tq, tk = sum(seqlens_q), sum(seqlens_k)
    gen = torch.Generator(device="cuda").manual_seed(23)
    make = lambda n, h: torch.randn(n, h, hdim, device="cuda",  # noqa: E731
                                    dtype=torch.bfloat16, generator=gen)
    q, k, v, dout = make(tq + 50, 4), make(tk + 70, 2), make(tk + 70, 2), make(tq + 50, 4)
    q[tq:], dout[tq:] = float("nan"), float("inf")
    k[tk:], v[tk:] = float("nan"), float("inf")

    def fn(a, b, c):
        return flash_attn_varlen_func(a, b, c, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                                      causal=causal, arch="hopper")[0]

    grads = _autograd_grads(fn, q, k, v, dout)
    for name, g, used in zip(("dQ", "dK", "dV"), grads, (tq, tk, tk)):
        assert (g[used:] == 0).all(), f"{name}: rows past the sequences are not zero"
    _check([g[:n] for g, n in zip(grads, (tq, tk, tk))], q[:tq], k[:tk], v[:tk], dout[:tq],
           causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_hopper_backward_every_gradient_element_is_written(monkeypatch):
    """Poison torch.empty with NaN: a dK/dV row the kernel skips would stay NaN."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    q, k, v, dout = _inputs(2, 333, 251, 4, 4, 128, 128, torch.bfloat16, seed=4)
    problem = validate_attention_inputs(q, k, v, window_size=(20, 0))
    out, lse = flash_attn_func(q, k, v, window_size=(20, 0), return_lse=True, arch="hopper")
    from flash_cute.arch.hopper.planner import backward

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    grads = backward(dout, None, q, k, v, out, lse, problem)
    monkeypatch.undo()
    assert all(not torch.isnan(g).any() for g in grads)
    _check(grads, q, k, v, dout, window_size=(20, 0))


_SCHEDULE_CASES = [(128, {"causal": True}), (64, {"softcap": 15.0}),
                   (128, {"window_size": (70, 9)})]


@pytest.mark.parametrize("tile,hdim,kw", [
    *[((64, 128, 2, swap), hdim, kw) for swap in (True, False) for hdim, kw in _SCHEDULE_CASES],
    # 128 query rows (hdim 64 only): transposed scores with shuffled LSE₂/Δ.
    ((128, 128, 2, True), 64, {"causal": True}), ((128, 128, 2, True), 64, {"softcap": 15.0}),
    ((128, 128, 2, True), 64, {"window_size": (70, 9)}),
    # 80 query rows (hdim 128 only): transposed scores and dQᵀ = Kᵀ dSᵀ.
    ((80, 128, 2, True), 128, {}), ((80, 128, 2, True), 128, {"causal": True}),
    ((80, 128, 2, True), 128, {"softcap": 15.0}),
    ((80, 128, 2, True), 128, {"window_size": (70, 9)}),
    # dK/dV transposed (swap_dkv): FA4's 48 keys at hdim 256 with two Q stages and one dO
    # stage, and its 96 keys at hdim 192.
    *[((64, 48, 2, False, True, 1), 256, kw) for _, kw in _SCHEDULE_CASES],
    ((64, 96, 2, False, True, 1), 192, {"causal": True}), ((64, 96, 2, False, True), 192, {}),
    # dQ handed over per warpgroup (dq_per_wg), at each kind of dQ split.
    *[((128, 128, 2, True, False, None, True), 64, kw) for _, kw in _SCHEDULE_CASES],
    ((80, 128, 2, True, False, None, True), 128, {"causal": True}),
    ((64, 128, 2, False, False, None, True), 128, {"window_size": (70, 9)}),
    ((64, 48, 2, False, True, 1, True), 256, {"causal": True}),
])
def test_hopper_backward_every_schedule(tile, hdim, kw):
    """S/dP computed transposed (P and dS kept in registers for dV and dK) or not (P and dS
    through shared memory), with 64, 80 or 128 query rows, dK/dV transposed with 48 or 96
    keys: every schedule passes the float64 rule (301 queries and 413 keys: a partial last
    tile of each size)."""
    from flash_cute.arch.hopper.config import BwdSchedule
    from flash_cute.arch.hopper.planner import backward

    q, k, v, dout = _inputs(2, 301, 413, 4, 2, hdim, hdim, torch.bfloat16, seed=hdim + tile[0])
    problem = validate_attention_inputs(q, k, v, **kw)
    out, lse = flash_attn_func(q, k, v, return_lse=True, arch="hopper", **kw)
    grads = backward(dout, None, q, k, v, out, lse, problem, schedule=BwdSchedule(*tile))
    _check(grads, q, k, v, dout, **kw)


def test_hopper_backward_new_lengths_reuse_the_compiled_kernel():
    from flash_cute.runtime.jit import compile_cache

    q, k, v, dout = _inputs(1, 100, 100, 2, 2, 64, 64, torch.bfloat16, seed=5)
    _hopper_grads(q, k, v, dout)
    before = len(compile_cache)
    for sq, sk, b in [(777, 555, 3), (64, 1000, 1)]:
        q, k, v, dout = _inputs(b, sq, sk, 2, 2, 64, 64, torch.bfloat16, seed=sq)
        _check(_hopper_grads(q, k, v, dout), q, k, v, dout)
    assert len(compile_cache) == before


def test_dispatcher_runs_the_hopper_backward_after_the_hopper_forward():
    from flash_cute.runtime.dispatch import pipeline_named, select_backward_pipeline

    for name in ("hopper", "ampere"):
        pipeline = pipeline_named(name)
        assert select_backward_pipeline(torch.device("cuda"), pipeline) is pipeline


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _autograd_grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, dout)


@pytest.mark.parametrize("hdim,h,hk,sq,sk,kw", [
    (128, 8, 2, 333, 1029, {}),                            # GQA, 9 K/V tiles per query tile
    (128, 4, 4, 1029, 777, {"causal": True}),
    (64, 6, 3, 517, 901, {"window_size": (150, 30)}),      # local: turns start past block 0
    (256, 4, 1, 300, 700, {"causal": True}),               # the dQ tile in one part, MQA
])
def test_hopper_deterministic_backward_is_bitwise_reproducible(hdim, h, hk, sq, sk, kw):
    """deterministic=True through flash_attn_func and autograd: dQ, dK, dV are bitwise equal
    over 10 runs, and within the float64 tolerance."""
    q, k, v, dout = _inputs(2, sq, sk, h, hk, hdim, hdim, torch.bfloat16, seed=sq + sk)

    def fn(a, b, c):
        return flash_attn_func(a, b, c, deterministic=True, arch="hopper", **kw)[0]

    first = _autograd_grads(fn, q, k, v, dout)
    for _ in range(9):
        again = _autograd_grads(fn, q, k, v, dout)
        for name, a, b in zip(("dQ", "dK", "dV"), first, again):
            assert _bitwise_equal(a, b), f"{name} differs between deterministic runs"
    _check(first, q, k, v, dout, **kw)


def test_hopper_deterministic_varlen_backward_is_bitwise_reproducible():
    seqlens_q, seqlens_k = [300, 0, 77, 513], [450, 33, 1, 600]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(seqlens_q), cu(seqlens_k)
    gen = torch.Generator(device="cuda").manual_seed(21)
    make = lambda n, h: torch.randn(n, h, 128, device="cuda",  # noqa: E731
                                    dtype=torch.bfloat16, generator=gen)
    q, k, v = make(sum(seqlens_q), 4), make(sum(seqlens_k), 2), make(sum(seqlens_k), 2)
    dout = make(sum(seqlens_q), 4)

    def fn(a, b, c):
        return flash_attn_varlen_func(a, b, c, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                                      causal=True, deterministic=True, arch="hopper")[0]

    first = _autograd_grads(fn, q, k, v, dout)
    for _ in range(9):
        again = _autograd_grads(fn, q, k, v, dout)
        assert all(_bitwise_equal(a, b) for a, b in zip(first, again))
    _check(first, q, k, v, dout, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("tile,hdim,varlen", [
    ((128, 128, 2, True, False, None, True), 64, False),     # dq_per_wg: two bulk adds
    ((64, 128, 2, False, False, None, True), 128, True),
    ((128, 128, 2, True, False, None, False), 64, False),    # the whole tile: one bulk add
    ((64, 64, 2), 256, False),                               # no dQ tile: fp32 atomics
])
def test_each_dq_hand_over_is_deterministic_and_handles_varlen(tile, hdim, varlen):
    """deterministic=True with each way dQ leaves: dq_per_wg's two bulk adds per query tile
    inside one turn of the semaphore, one bulk add of the whole tile, fp32 atomics; bitwise
    equal over 5 runs, padded and varlen (tiles of different sequences)."""
    from flash_cute.arch.hopper.config import BwdSchedule
    from flash_cute.arch.hopper.planner import backward

    if varlen:
        lens = [300, 0, 77, 513]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                          device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(31)
        make = lambda h: torch.randn(sum(lens), h, hdim, device="cuda",  # noqa: E731
                                     dtype=torch.bfloat16, generator=gen)
        q, k, v, dout = make(4), make(2), make(2), make(4)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                  max_seqlen_k=max(lens), causal=True)
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True,
                                          return_lse=True, arch="hopper")
        problem = validate_attention_inputs(q, k, v, **kw)
        run = lambda: backward(dout, None, q, k, v, out, lse, problem, cu, cu,  # noqa: E731
                               deterministic=True, schedule=BwdSchedule(*tile))
        ref_kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v, dout = _inputs(2, 517, 901, 4, 2, hdim, hdim, torch.bfloat16, seed=41)
        out, lse = flash_attn_func(q, k, v, return_lse=True, arch="hopper")
        problem = validate_attention_inputs(q, k, v)
        run = lambda: backward(dout, None, q, k, v, out, lse, problem,  # noqa: E731
                               deterministic=True, schedule=BwdSchedule(*tile))
        ref_kw = {}
    first = run()
    for _ in range(4):
        assert all(_bitwise_equal(a, b) for a, b in zip(first, run()))
    _check(first, q, k, v, dout, **ref_kw)
