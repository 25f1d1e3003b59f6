"""The software exp2 (`flash_cute.blocks.exp2_emu`) on the GPU: the block over every float32 in
[-126, 0] against exact 2^x and against the model of its arithmetic, and attention with the
switch on against float64 by the FlashAttention rule (the ampere and hopper forwards)."""

import pytest
import torch
from attention_checks import check_forward

from flash_cute import flash_attn_func
from flash_cute.reference.block_models import exp2_poly
from flash_cute.runtime.plans import clear_plans

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_block_over_every_float32_from_minus_126_to_0():
    """Every float32 bit pattern from -0 down to -126: the relative error against 2^x in
    float64 (the issue's bound: 2e-4 at degree 3), and bit equality with the fused model."""
    from flash_cute.tools.block_kernels import exp2_emulated_on_gpu as evaluate

    first, last = 0x80000000, 0xC2FC0000   # -0.0 and -126.0 as bits; magnitudes grow with them
    chunk = 1 << 27
    worst, mismatches, count = 0.0, 0, 0
    for start in range(first, last + 1, chunk):
        bits = torch.arange(start, min(start + chunk, last + 1), device="cuda",
                            dtype=torch.int64)
        x = (bits - (1 << 32)).to(torch.int32).view(torch.float32)
        y = evaluate(x)
        exact = torch.exp2(x.double())
        worst = max(worst, ((y.double() - exact) / exact).abs().max().item())
        mismatches += int((y.view(torch.int32) != exp2_poly(x, fused=True).view(torch.int32))
                          .sum())
        count += x.numel()
    print(f"software exp2 over {count:,} float32 in [-126, 0]: max relative error {worst:.3e}, "
          f"{mismatches} results differ from the fused model")
    assert count == last - first + 1
    assert worst <= 2e-4
    assert mismatches <= count * 1e-6


@pytest.mark.parametrize("arch", [None, "ampere"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_attention_with_the_switch_on_meets_the_rule(monkeypatch, arch, causal, d):
    monkeypatch.setenv("FLASH_CUTE_EX2_EMULATION", "0.25")
    clear_plans()
    try:
        gen = torch.Generator(device="cuda").manual_seed(d + causal)
        q, k, v = (torch.randn(2, 1013, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, arch=arch)
        check_forward(out, lse, q, k, v, causal=causal)
        monkeypatch.delenv("FLASH_CUTE_EX2_EMULATION")
        clear_plans()
        plain, _ = flash_attn_func(q, k, v, causal=causal, return_lse=True, arch=arch)
        assert not torch.equal(out, plain)   # the switch reached the kernel
    finally:
        clear_plans()
