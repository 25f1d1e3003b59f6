"""Context parallelism with the real kernels on one GPU: ranks share the GPU over gloo (NCCL
refuses two ranks on one device; gloo moves CPU tensors, so K/V go through host memory), and
each layout's ring and Ulysses, forward and backward, match single-GPU `flash_attn_func` by
the FlashAttention rule against float64 attention over the whole sequence."""

import pytest
import torch
from ranks import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = (("zigzag", "ring", True, (-1, -1)), ("striped", "ring", False, (-1, -1)),
         ("contiguous", "ring", True, (64, 0)), ("zigzag", "ulysses", True, (-1, -1)),
         ("contiguous", "ulysses", False, (100, 20)))


def _cases(rank, world):
    import flash_cute
    from flash_cute.parallel import positions, ring_attention, ulysses_attention
    from flash_cute.reference.attention import attention_ref, tolerance_check

    torch.cuda.set_device(0)
    errors = {}
    for layout, kind, causal, window in CASES:
        seqlen = 256 * world
        g = torch.Generator(device="cuda").manual_seed(7)
        q, dout = (torch.randn(2, seqlen, 8, 128, device="cuda", generator=g) for _ in range(2))
        k, v = (torch.randn(2, seqlen, 4, 128, device="cuda", generator=g) for _ in range(2))
        q, k, v, dout = (t.to(torch.bfloat16) for t in (q, k, v, dout))
        kw = dict(causal=causal, window_size=window)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        single = flash_cute.flash_attn_func(*leaves, **kw)[0]
        single.backward(dout)
        exact = [t.double().requires_grad_(True) for t in (q, k, v)]
        out64, _ = attention_ref(*exact, **kw)
        out64.backward(dout.double())
        pos = positions(seqlen, layout, world, rank)
        mine = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
        call = ring_attention if kind == "ring" else ulysses_attention
        out = call(*mine, layout=layout, **kw)
        out.backward(dout[:, pos])
        checks = [("out", out, out64[:, pos], single[:, pos])]
        checks += [(n, got.grad, ref.grad[:, pos], nat.grad[:, pos])
                   for n, got, ref, nat in zip(("dq", "dk", "dv"), mine, exact, leaves)]
        for name, got, ref, native in checks:
            res = tolerance_check(got, ref, native)
            assert res.ok, (layout, kind, causal, window, name, res)
            errors[f"{kind} {name}"] = max(errors.get(f"{kind} {name}", 0.0), res.err)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_the_kernels_inside_the_ring_and_ulysses_match_one_gpu(world):
    results = run(world, _cases, timeout=600)
    assert all(r for r in results)
