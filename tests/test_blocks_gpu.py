"""The shared blocks on the GPU: online softmax + mask + block range (through the score-attention
kernel) and the LSE merge kernel, against float64 PyTorch. Skipped without CUDA."""

import math

import pytest
import torch

from flash_cute.reference.attention import attention_mask
from flash_cute.reference.block_models import lse_merge as lse_merge_model

pytestmark = pytest.mark.gpu

LN2 = math.log(2.0)


def _scores_reference(scores, v, scale, causal, window, softcap):
    """float64 O and LSE of softmax(mask(softcap(S * scale))) V, and the bf16-style O."""
    b, sq, sk = scores.shape
    s = scores.double() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    visible = attention_mask(sq, sk, causal, window, device=scores.device)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).nan_to_num(0.0)
    out = p @ v.double()
    # "As PyTorch would do it" in the input dtype: P rounded to v's dtype, matmul in that dtype.
    native = (p.float().to(v.dtype) @ v).double()
    return out, lse, native


def _check(out, out_ref, native, what):
    err = (out.double() - out_ref).abs().max().item()
    native_err = (native - out_ref).abs().max().item()
    assert math.isfinite(err), f"{what}: non-finite output (unwritten or NaN)"
    assert err <= 2 * native_err + 1e-4, f"{what}: err {err:.3e} > 2 x native {native_err:.3e}"


CASES = [
    # (batch, sq, sk, causal, window, softcap, dtype)
    (2, 1, 1, False, (None, None), 0.0, torch.bfloat16),
    (3, 77, 131, False, (None, None), 0.0, torch.bfloat16),
    (2, 200, 133, True, (None, None), 0.0, torch.bfloat16),
    (2, 131, 257, True, (None, None), 0.0, torch.float16),
    (1, 190, 190, False, (37, 11), 0.0, torch.bfloat16),
    (2, 65, 300, True, (50, None), 30.0, torch.bfloat16),
    (1, 129, 64, False, (None, 0), 5.0, torch.float16),
]


@pytest.mark.parametrize("batch,sq,sk,causal,window,softcap,dtype", CASES)
def test_score_attention_matches_float64(batch, sq, sk, causal, window, softcap, dtype):
    from flash_cute.tools.block_kernels import score_attention

    gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + sk)
    scores = torch.randn(batch, sq, sk, device="cuda", generator=gen) * 4.0
    v = torch.randn(batch, sk, 16, device="cuda", generator=gen).to(dtype)
    scale = 0.37
    out = torch.full((batch, sq, 16), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((batch, sq), float("nan"), device="cuda")
    score_attention(scores, v, scale, causal, window, softcap, out=out, lse=lse)
    out_ref, lse_ref, native = _scores_reference(scores, v, scale, causal, window, softcap)
    _check(out, out_ref, native, "O")
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no visible key must have LSE = -inf"
    assert (out[empty] == 0).all(), "rows with no visible key must have O = 0"
    lse_err = (lse.double() - lse_ref)[~empty].abs().max().item() if (~empty).any() else 0.0
    assert lse_err < 1e-4 * max(1.0, lse_ref[~empty].abs().max().item())


def test_seed_worked_example_on_gpu():
    """Seed 10.3.2: scores [1, 3, 2], V = [10, 20, 30] -> O = 21.547, LSE = 3.4076."""
    from flash_cute.tools.block_kernels import score_attention

    scores = torch.tensor([[[1.0, 3.0, 2.0]]], device="cuda")
    v = torch.tensor([10.0, 20.0, 30.0], device="cuda").view(1, 3, 1).expand(1, 3, 16)
    out, lse = score_attention(scores, v.to(torch.bfloat16).contiguous(), softmax_scale=1.0)
    assert abs(lse.item() - 3.4076) < 1e-4
    # bf16 has 8 bits of mantissa: 21.547 rounds to 21.5.
    assert torch.allclose(out.float(), torch.full_like(out.float(), 21.547), atol=0.1)


@pytest.mark.parametrize("splits,rows,hdim", [(1, 33, 64), (2, 1000, 128), (7, 129, 256)])
def test_lse_merge_matches_model(splits, rows, hdim):
    from flash_cute.runtime.lse_merge import lse_merge

    gen = torch.Generator(device="cuda").manual_seed(splits * rows)
    o_parts = torch.randn(splits, rows, hdim, device="cuda", generator=gen)
    lse_parts = torch.randn(splits, rows, device="cuda", generator=gen) * 5
    lse_parts[0, ::3] = -math.inf  # a part that saw no key for these rows
    lse_parts[:, 5] = -math.inf  # a row that saw no key at all
    out = torch.full((rows, hdim), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((rows,), float("nan"), device="cuda")
    lse_merge(o_parts, lse_parts, out=out, lse=lse)
    out_ref, lse_ref = lse_merge_model(o_parts.double(), lse_parts.double())
    assert torch.isneginf(lse[5]) and (out[5] == 0).all()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double() - lse_ref)[finite].abs().max() < 1e-5 * 20
    # Output is rounded to bf16 once: error within half an ulp of bf16 plus fp32 noise.
    bound = out_ref.abs() * 2.0**-8 + 1e-5
    assert ((out.double() - out_ref).abs() <= bound).all()
