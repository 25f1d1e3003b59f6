"""The software exp2 (`flash_cute.blocks.exp2_emu`) on the CPU: the policy's share, the switch, the
compile-time flag, and the model of the kernels' arithmetic (FMA rounding) against exact 2^x.
Its SASS (MUFU.EX2 dropping by the share, 3 FFMA per emulated value) is checked by
tests/test_inspect.py::test_software_exp2_takes_its_share_off_mufu."""

import pytest
import torch

from flash_cute.blocks.exp2_emu import emulated
from flash_cute.contract.variant import Variant, ex2_emulation_per16, per16_of
from flash_cute.reference.block_models import EXP2_POLY_MAX_REL_ERR, exp2_poly
from flash_cute.tools.kernel_config import variant_from_flags


@pytest.mark.parametrize("per16", range(17))
def test_policy_takes_exactly_its_share_of_every_16_positions(per16):
    for start in range(0, 64, 16):
        picked = [p for p in range(start, start + 16) if emulated(p, per16)]
        assert len(picked) == per16
    # Spread evenly: no run of 16 // per16 positions holds two of them.
    if per16:
        picked = [p for p in range(64) if emulated(p, per16)]
        assert min(b - a for a, b in zip(picked, picked[1:]) or [(0, 16)]) >= 16 // per16


def test_share_from_a_fraction_and_the_switch(monkeypatch):
    assert per16_of(0.125) == 2 and per16_of(0) == 0 and per16_of(1.0) == 16
    for bad in (0.1, -0.0625, 1.0625):
        with pytest.raises(ValueError, match="multiple of 1/16"):
            per16_of(bad)
    monkeypatch.delenv("FLASH_CUTE_EX2_EMULATION", raising=False)
    assert ex2_emulation_per16() == 0
    monkeypatch.setenv("FLASH_CUTE_EX2_EMULATION", "0.1875")
    assert ex2_emulation_per16() == 3
    monkeypatch.setenv("FLASH_CUTE_EX2_EMULATION", "most")
    with pytest.raises(ValueError, match="not a number"):
        ex2_emulation_per16()


def test_the_flag_joins_the_compile_key_only_when_on():
    assert Variant(causal=True).flags() == Variant(causal=True, ex2_per16=0).flags()
    on = Variant(causal=True, ex2_per16=2)
    assert ("ex2_emu", 2) in on.flags()
    assert variant_from_flags(dict(on.flags())) == on


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_fused_model_meets_the_bound_and_is_exact_at_integers(degree):
    x = torch.cat([torch.linspace(-126.0, 0.0, 1_000_001), torch.rand(100_000) * -126])
    exact = torch.exp2(x.double())
    rel = ((exp2_poly(x, degree, fused=True).double() - exact) / exact).abs().max().item()
    assert rel <= EXP2_POLY_MAX_REL_ERR[degree] * 1.01
    j = torch.arange(-126, 1, dtype=torch.float32)
    assert torch.equal(exp2_poly(j, degree, fused=True), torch.exp2(j))
    assert exp2_poly(torch.tensor([-float("inf"), -500.0]), degree, fused=True).eq(0).all()


def test_fused_and_unfused_models_differ_only_in_the_last_bits():
    """One rounding per Horner step (the kernels' FMA) moves results by at most a few ulps
    from a multiply and an add: the model must say which one it is."""
    x = torch.linspace(-20.0, 0.0, 200_001)
    fused, plain = exp2_poly(x, fused=True), exp2_poly(x)
    ulps = (fused.view(torch.int32) - plain.view(torch.int32)).abs().max().item()
    assert 0 < ulps <= 4 and (fused != plain).any()
