"""Assertions the GPU tests share: forward outputs against float64 by the FlashAttention rule."""

from flash_cute.reference import attention_ref, tolerance_check


def check_forward(out, lse, q, k, v, **kw):
    """O and LSE of an attention forward against float64, each within twice the error of the
    same computation in q's dtype (`tolerance_check`); `kw` are `attention_ref`'s."""
    out_ref, lse_ref = attention_ref(q, k, v, mode="float64", **kw)
    out_nat, lse_nat = attention_ref(q, k, v, mode="native", **kw)
    res = tolerance_check(out, out_ref, out_nat)
    assert res.ok, f"O: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"
    # LSE sees only QKᵀ rounding; allow the same rule with an fp32-sized atol.
    res = tolerance_check(lse, lse_ref, lse_nat, atol=1e-4)
    assert res.ok, f"LSE: err {res.err:.3e} vs native {res.err_native:.3e}"
