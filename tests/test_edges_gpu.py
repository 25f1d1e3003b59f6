"""Numerical edges and concurrent first calls, on the GPU (issue 21)."""

import threading

import pytest
import torch
from attention_checks import check_forward

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference.attention import attention_ref, tolerance_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, grad=False):
    t = (torch.randn(*shape, device="cuda") * scale).to(dtype)
    return t.requires_grad_() if grad else t


@pytest.mark.parametrize("softmax_scale,q_scale", [(1000.0, 1.0), (None, 1e4)])
def test_scores_of_magnitude_1e4_stay_finite(softmax_scale, q_scale):
    """Scores around 1e4 (a large scale, or large inputs): no inf or NaN where the reference
    is finite, and the FlashAttention rule holds."""
    q = _randn(2, 257, 4, 64, scale=q_scale)
    k, v = _randn(2, 301, 4, 64), _randn(2, 301, 4, 64)
    out, lse = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_forward(out, lse, q, k, v, softmax_scale=softmax_scale, causal=True)


def test_fully_masked_rows_give_zero_output_and_gradient():
    """Causal with more queries than keys (bottom-right): the first sq - sk rows see no key:
    O = 0, LSE = -inf, and they pass no gradient."""
    q = _randn(1, 300, 2, 64, grad=True)
    k, v = _randn(1, 100, 2, 64, grad=True), _randn(1, 100, 2, 64, grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert (out[:, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq[:, :200] == 0).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_a_nan_stays_in_its_own_sequence():
    """A NaN in one sequence of a varlen batch does not reach the others' outputs."""
    lens = (77, 130, 50)
    cu = torch.tensor([0, 77, 207, 257], dtype=torch.int32, device="cuda")
    q, k, v = (_randn(257, 4, 64) for _ in range(3))
    k[80] = float("nan")  # inside sequence 1
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=max(lens), max_seqlen_k=max(lens), return_lse=True)
    assert torch.isnan(out[77:207]).any()
    clean = torch.cat([out[:77], out[207:]])
    assert torch.isfinite(clean).all()
    for a, b in ((0, 77), (207, 257)):
        sub = slice(a, b)
        check_forward(out[sub][None], lse[:, sub][None], q[sub][None], k[sub][None],
                      v[sub][None])


@pytest.mark.parametrize("arch", ["hopper", "ampere"])
def test_no_query_rows_with_gqa(arch):
    """A varlen batch whose every query sequence is empty, with GQA (the fuzz found the
    packing heuristic dividing by zero here): empty outputs, zero K/V gradients."""
    if arch == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs sm90")
    cu_q = torch.tensor([0, 0], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 333], dtype=torch.int32, device="cuda")
    q = _randn(0, 8, 64, grad=True)
    k, v = _randn(333, 2, 64, grad=True), _randn(333, 2, 64, grad=True)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=0, max_seqlen_k=333, causal=True,
                                      return_lse=True, arch=arch)
    assert out.shape == (0, 8, 64) and lse.shape == (8, 0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()


def test_fp16_values_near_65504():
    """fp16 V entries near the largest finite fp16: O stays finite (a convex mix of V) and
    within the rule."""
    q, k = _randn(1, 129, 2, 64, dtype=torch.float16), _randn(1, 129, 2, 64, dtype=torch.float16)
    v = (torch.rand(1, 129, 2, 64, device="cuda") * 2e3 + 6.3e4).to(torch.float16)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert torch.isfinite(out).all()
    check_forward(out, lse, q, k, v)


def test_eight_threads_of_first_calls_compile_each_kernel_once():
    """Eight threads call at once with different shapes and variants, several of them first
    calls that compile: every result is right and every kernel is compiled once."""
    from flash_cute.runtime import jit

    shapes = [(1, 97 + 13 * i, 4, (64, 128)[i % 2], i % 3 == 0) for i in range(8)]
    results, errors = [None] * 8, []
    builds = []
    real_get = jit.compile_cache.get

    def counting_get(key, build, options=""):
        def counted():
            builds.append(key)
            return build()
        return real_get(key, counted, options)

    jit.compile_cache.get = counting_get
    barrier = threading.Barrier(8)

    def work(i):
        try:
            b, s, h, d, causal = shapes[i]
            q, k, v = (_randn(b, s, h, d) for _ in range(3))
            barrier.wait()
            out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
            torch.cuda.synchronize()
            ref, _ = attention_ref(q, k, v, causal=causal, mode="float64")
            nat, _ = attention_ref(q, k, v, causal=causal, mode="native")
            results[i] = tolerance_check(out, ref, nat).ok
        except Exception as exc:  # noqa: BLE001 - any exception is the failure
            errors.append(repr(exc))

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        jit.compile_cache.get = real_get
    assert errors == [] and all(results), (errors, results)
    assert len(builds) == len(set(builds)), builds
