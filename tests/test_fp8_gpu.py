"""The Hopper FP8 forward on the GPU, held to its model: the kernel's error against float64 of
the dequantized inputs within 1.25x of the emulation's (the same scales, the same P x 256
e4m3 path), per config, at every head dim and feature."""

import pytest
import torch

from flash_cute.fp8 import dequantize_fp8, emulate, flash_attn_fp8, quantize_fp8
from flash_cute.reference.attention import attention_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() != (9, 0),
                                 reason="the FP8 kernel runs on Hopper (sm_90a)")]


def _inputs(d, dv, b=2, sq=333, sk=517, h=8, hk=2, block=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, e, device="cuda", generator=g)
               for s, n, e in ((sq, h, d), (sk, hk, d), (sk, hk, dv)))
    if block is None:
        # FA3's q_descale is per K/V head: quantize each group of query heads together.
        q8, qd = quantize_fp8(q.reshape(b, sq, hk, -1), block=None)
        q8, qs = q8.view(b, sq, h, d), qd.repeat_interleave(h // hk, dim=1)
    else:
        (q8, qs), qd = quantize_fp8(q), None
    (k8, ks), (v8, vs) = quantize_fp8(k, block=block), quantize_fp8(v, block=block)
    return (q8, k8, v8), (qd if block is None else qs, ks, vs), (qs, ks, vs)


def _rmse_max(out, ref):
    diff = (out.double() - ref.double())
    return diff.pow(2).mean().sqrt().item(), diff.abs().max().item()


def _check(out, ref, emu):
    assert torch.isfinite(out).all()
    k_rmse, k_max = _rmse_max(out, ref)
    e_rmse, e_max = _rmse_max(emu.to(out.device), ref)
    assert k_rmse <= 1.25 * e_rmse + 1e-6 and k_max <= 1.25 * e_max + 1e-5, \
        (k_rmse, e_rmse, k_max, e_max)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [None, 128])
def test_the_fp8_kernel_is_within_its_emulations_error(dims, causal, block):
    (q8, k8, v8), call_scales, per_head = _inputs(*dims, block=block)
    out = flash_attn_fp8(q8, k8, v8, *call_scales, causal=causal)
    deq = [dequantize_fp8(t, s, block=block) for t, s in zip((q8, k8, v8), per_head)]
    ref, _ = attention_ref(*deq, causal=causal)
    emu, _ = emulate(*(t.cpu() for t in (q8, k8, v8)), *(s.cpu() for s in per_head),
                     causal=causal, block=block,
                     tile_n=64 if dims[0] == 256 else 128)
    _check(out, ref, emu)


@pytest.mark.parametrize("case", ["varlen+seqused_k", "paged+split", "pack_gqa", "local+softcap"])
def test_the_fp8_kernels_features_are_within_the_emulations_error(case):
    (q8, k8, v8), (qd, ks, vs), per_head = _inputs(128, 128)
    deq = [dequantize_fp8(t, s, block=None) for t, s in zip((q8, k8, v8), per_head)]
    used = torch.tensor([517, 300], dtype=torch.int32, device="cuda")
    cpu = lambda ts: [t.cpu() for t in ts]  # noqa: E731
    if case == "varlen+seqused_k":
        cu_q = torch.tensor([0, 333, 666], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 517, 1034], dtype=torch.int32, device="cuda")
        flat = [t.flatten(0, 1) for t in (q8, k8, v8)]
        out = flash_attn_fp8(*flat, qd, ks, vs, causal=True, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen_q=333, max_seqlen_k=517,
                             seqused_k=used).view(2, 333, 8, 128)
        kw = dict(causal=True, seqused_k=used.cpu())
    elif case == "paged+split":
        pages = 64
        padded = (torch.nn.functional.pad(t.float(), (0, 0, 0, 0, 0, 9 * pages - 517))
                  for t in (k8, v8))
        order = torch.randperm(18, device="cuda")
        cache = [t.to(torch.float8_e4m3fn).reshape(18, pages, 2, 128)[order] for t in padded]
        table = torch.argsort(order).view(2, 9).to(torch.int32)
        out = flash_attn_fp8(q8, *cache, qd, ks, vs, seqused_k=used, page_table=table,
                             num_splits=3)
        kw = dict(seqused_k=used.cpu())
    elif case == "pack_gqa":
        out = flash_attn_fp8(q8, k8, v8, qd, ks, vs, causal=True, pack_gqa=True)
        kw = dict(causal=True)
    else:
        out = flash_attn_fp8(q8, k8, v8, qd, ks, vs, window_size=(100, 40), softcap=12.0)
        kw = dict(window_size=(100, 40), softcap=12.0)
    ref_kw = dict(kw)
    if "seqused_k" in ref_kw:
        ref_kw["seqused_k"] = used
    ref, _ = attention_ref(*deq, **ref_kw)
    emu, _ = emulate(*cpu((q8, k8, v8)), *cpu(per_head), block=None, **kw)
    _check(out, ref, emu)


def test_incoherent_runs_one_fused_kernel_on_cuda():
    """On CUDA `incoherent` is one Triton kernel per tensor (the sign flip and every
    butterfly stage in registers, one rounding to the input dtype), where the torch
    butterflies round each stage: held to float64's transform, it is no further from it,
    in the largest and in the mean error."""
    from torch.profiler import ProfilerActivity, profile

    from flash_cute.fp8 import incoherent

    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1037, 2, 128, device="cuda", dtype=torch.bfloat16)
    exact = incoherent(q.double(), k.double(), 5, fused=False)
    for fused, plain, want in zip(incoherent(q, k, 5), incoherent(q, k, 5, fused=False),
                                  exact):
        fused_err = (fused.double() - want).abs()
        plain_err = (plain.double() - want).abs()
        assert fused_err.max() <= plain_err.max()
        assert fused_err.mean() <= plain_err.mean()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        incoherent(q, k, 5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"
               and "memcpy" not in e.name.lower()]
    assert len(kernels) == 2 and all("signed_fwht" in n for n in kernels), kernels
