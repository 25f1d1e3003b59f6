"""The Hopper forward's schedules (FA3's intra-warpgroup overlap and ping-pong, each on and off)
against float64 by the FlashAttention rule. The default schedule runs the whole feature matrix
in tests/test_attention_gpu.py; here every other schedule sees the cases that stress it: one
K/V block (no loop body), many blocks, masked rows with no key, causal and local block
skipping, varlen. Needs an H100/H200.
"""

import pytest
import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, tolerance_check
from flash_cute.validation import validate_attention_inputs

pytestmark = pytest.mark.gpu

SCHEDULES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.fixture(autouse=True)
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper forward needs an sm90 GPU")


def _forward(q, k, v, overlap, pingpong, cu_q=None, cu_k=None, max_q=None, max_k=None, **kw):
    from flash_cute.arch.hopper import api
    from flash_cute.arch.hopper.config import TILES

    problem = validate_attention_inputs(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        max_seqlen_q=max_q, max_seqlen_k=max_k, **kw)
    tile = TILES[q.shape[-1]]._replace(intra_wg_overlap=overlap, pingpong=pingpong)
    return api.forward(q, k, v, problem, cu_q, cu_k, tile=tile)


def _check(out, lse, q, k, v, **kw):
    out_ref, lse_ref = attention_ref(q, k, v, mode="float64", **kw)
    out_nat, lse_nat = attention_ref(q, k, v, mode="native", **kw)
    res = tolerance_check(out, out_ref, out_nat)
    assert res.ok, f"O: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"
    res = tolerance_check(lse, lse_ref, lse_nat, atol=1e-4)
    assert res.ok, f"LSE: err {res.err:.3e} vs native {res.err_native:.3e}"


def _inputs(shape_q, shape_k, seed, d=128, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, d, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(*shape_q), make(*shape_k), make(*shape_k)


@pytest.mark.parametrize("overlap,pingpong", SCHEDULES)
@pytest.mark.parametrize("sq,sk,kw", [
    (77, 93, {}),                                 # one K/V block: prologue and epilogue only
    (300, 1000, {"causal": True}),                # every row sees many blocks
    (1000, 300, {"causal": True}),                # first 700 rows see no key
    (513, 777, {"window_size": (100, 50), "softcap": 20.0}),
])
def test_every_schedule_matches_float64(overlap, pingpong, sq, sk, kw):
    q, k, v = _inputs((2, sq, 4), (2, sk, 2), seed=sq + sk)
    out, lse = _forward(q, k, v, overlap, pingpong, **kw)
    _check(out, lse, q, k, v, **kw)


@pytest.mark.parametrize("overlap,pingpong", SCHEDULES)
def test_every_schedule_handles_varlen(overlap, pingpong):
    seqlens_q, seqlens_k = [37, 0, 129, 1, 300], [50, 17, 0, 1, 257]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(seqlens_q), cu(seqlens_k)
    q, k, v = _inputs((sum(seqlens_q), 6), (sum(seqlens_k), 2), seed=3)
    out, lse = _forward(q, k, v, overlap, pingpong, cu_q, cu_k, max(seqlens_q), max(seqlens_k),
                        causal=True)
    _check(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_schedules_are_separate_compiled_kernels():
    from flash_cute.jit import compile_cache

    q, k, v = _inputs((1, 100, 2), (1, 100, 2), seed=5)
    before = len(compile_cache)
    outs = [_forward(q, k, v, o, p)[0] for o, p in SCHEDULES]
    assert len(compile_cache) >= before + 1
    for out in outs[1:]:
        # Same math, same order of additions within a row: only the schedule differs.
        assert torch.equal(out, outs[0])
