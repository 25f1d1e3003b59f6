"""What several tests share: forward outputs against float64 by the FlashAttention rule, and
a small transformer block for the torch.compile tests."""

import torch

from flash_cute import flash_attn_func
from flash_cute.reference.attention import attention_ref, tolerance_check


class AttentionBlock(torch.nn.Module):
    """Pre-norm attention block with GQA and a causal mask, attention by flash_attn_func."""

    def __init__(self, dim=128, heads=4, heads_kv=2, norm=torch.nn.LayerNorm, bias=True):
        super().__init__()
        self.heads, self.heads_kv, self.hd = heads, heads_kv, dim // heads
        self.norm = norm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * heads_kv) * self.hd, bias=bias)
        self.proj = torch.nn.Linear(heads * self.hd, dim, bias=bias)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, self.heads + 2 * self.heads_kv, self.hd)
        q, k, v = qkv.split([self.heads, self.heads_kv, self.heads_kv], dim=2)
        out, _ = flash_attn_func(q, k, v, causal=True)
        return x + self.proj(out.reshape(b, t, -1))


def check_forward(out, lse, q, k, v, **kw):
    """O and LSE (unless None) of an attention forward against float64, each within twice
    the error of the same computation in q's dtype (`tolerance_check`); `kw` are
    `attention_ref`'s."""
    out_ref, lse_ref = attention_ref(q, k, v, mode="float64", **kw)
    out_nat, lse_nat = attention_ref(q, k, v, mode="native", **kw)
    res = tolerance_check(out, out_ref, out_nat)
    assert res.ok, f"O: err {res.err:.3e} vs native {res.err_native:.3e} (+atol {res.atol:.1e})"
    if lse is None:
        return
    # LSE sees only QKᵀ rounding; allow the same rule with an fp32-sized atol.
    res = tolerance_check(lse, lse_ref, lse_nat, atol=1e-4)
    assert res.ok, f"LSE: err {res.err:.3e} vs native {res.err_native:.3e}"
