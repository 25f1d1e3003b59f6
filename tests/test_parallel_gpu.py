"""Context parallelism with the real kernels on one GPU: ranks share the GPU over gloo (NCCL
refuses two ranks on one device; gloo moves CPU tensors, so K/V go through host memory), and
each layout's ring and Ulysses, forward and backward, with and without dropout, match
single-GPU `flash_attn_func` by the FlashAttention rule against float64 attention over the
whole sequence."""

import pytest
import torch
from ranks import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (layout, kind, causal, window, dropout_p): dropout on zigzag's shards of 128-token chunks
# (the kernels' Philox groups stay whole), striped (a block per element), and Ulysses (its
# heads' offset).
CASES = (("zigzag", "ring", True, (-1, -1), 0.0), ("striped", "ring", False, (-1, -1), 0.0),
         ("contiguous", "ring", True, (64, 0), 0.0), ("zigzag", "ulysses", True, (-1, -1), 0.0),
         ("contiguous", "ulysses", False, (100, 20), 0.0),
         ("zigzag", "ring", True, (-1, -1), 0.2), ("striped", "ring", False, (100, 3), 0.15),
         ("zigzag", "ulysses", True, (-1, -1), 0.1))


def _cases(rank, world):
    import flash_cute
    from flash_cute.parallel import positions, ring_attention, ulysses_attention
    from flash_cute.reference.attention import attention_ref, tolerance_check

    torch.cuda.set_device(0)
    errors = {}
    from flash_cute.reference.rng import draw_seed

    for layout, kind, causal, window, drop in CASES:
        seqlen = 256 * world
        g = torch.Generator(device="cuda").manual_seed(7)
        q, dout = (torch.randn(2, seqlen, 8, 128, device="cuda", generator=g) for _ in range(2))
        k, v = (torch.randn(2, seqlen, 4, 128, device="cuda", generator=g) for _ in range(2))
        q, k, v, dout = (t.to(torch.bfloat16) for t in (q, k, v, dout))
        kw = dict(causal=causal, window_size=window)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        # The single-GPU call draws its dropout seed from the CUDA generator; the same draw
        # repeated is the seed the ring is given.
        torch.manual_seed(5)
        single = flash_cute.flash_attn_func(*leaves, dropout_p=drop, **kw)[0]
        single.backward(dout)
        torch.manual_seed(5)
        seed = draw_seed("cuda")
        exact = [t.double().requires_grad_(True) for t in (q, k, v)]
        out64, _ = attention_ref(*exact, dropout=(drop, seed) if drop else None, **kw)
        out64.backward(dout.double())
        pos = positions(seqlen, layout, world, rank)
        mine = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
        call = ring_attention if kind == "ring" else ulysses_attention
        out = call(*mine, layout=layout, dropout_p=drop, dropout_seed=int(seed.item()), **kw)
        out.backward(dout[:, pos])
        checks = [("out", out, out64[:, pos], single[:, pos])]
        checks += [(n, got.grad, ref.grad[:, pos], nat.grad[:, pos])
                   for n, got, ref, nat in zip(("dq", "dk", "dv"), mine, exact, leaves)]
        for name, got, ref, native in checks:
            res = tolerance_check(got, ref, native)
            assert res.ok, (layout, kind, causal, window, drop, name, res)
            errors[f"{kind} {name}"] = max(errors.get(f"{kind} {name}", 0.0), res.err)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_the_kernels_inside_the_ring_and_ulysses_match_one_gpu(world):
    results = run(world, _cases, timeout=600)
    assert all(r for r in results)
