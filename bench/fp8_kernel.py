"""The FP8 forward on a Hopper GPU: its error against float64 of the dequantized inputs, beside
the emulation's (the kernel is held to 1.25x of it, per config). Its speed is
`python -m flash_cute bench fp8`.

    python bench/fp8_kernel.py [--json PATH]

Accuracy: N(0, 1) inputs quantized per (batch, K/V head) (FA3's descales), odd lengths, GQA;
plain, causal, local + softcap, seqused_k, packed GQA and block scales at every head dim, each
against float64 of the dequantized inputs and held to its own emulation's error (the same
call on CPU copies).
"""

import argparse
import json
import math

import torch

from flash_cute.fp8 import quantize_fp8
from flash_cute.fp8.attention import flash_attn_fp8
from flash_cute.fp8.emulation import emulate
from flash_cute.reference.attention import attention_ref

HDIMS = ((64, 64), (128, 128), (192, 128), (256, 256))


def _quantize(x):
    """e4m3 x and its float32 [b, h] descales (per batch entry and head)."""
    x8, scale = quantize_fp8(x, block=None)
    return x8, scale


def _quantize_q(q, heads_kv: int):
    """e4m3 q and FA3's q_descale [b, hk]: one scale per (batch entry, K/V head), shared by
    the group's query heads."""
    b, s, h, d = q.shape
    q8, scale = quantize_fp8(q.reshape(b, s, heads_kv, (h // heads_kv) * d), block=None)
    return q8.view(b, s, h, d), scale


def _per_head(scale, group: int):
    return scale.repeat_interleave(group, dim=1)


def _dequantized(x8, scale):
    return x8.double() * scale.double()[:, None, :, None]


def _errors(out, ref):
    diff = (out.double() - ref.double()).nan_to_num(nan=math.inf)
    return diff.pow(2).mean().sqrt().item(), diff.abs().max().item()


def _problem(d, dv, b=2, sq=1000, sk=1037, h=8, hk=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g)
    v = torch.randn(b, sk, hk, dv, device="cuda", generator=g)
    return _quantize_q(q, hk), _quantize(k), _quantize(v)


def accuracy() -> list:
    rows = []
    for d, dv in HDIMS:
        (q8, q_desc), (k8, ks), (v8, vs) = _problem(d, dv)
        qs = _per_head(q_desc, q8.shape[2] // k8.shape[2])
        ref_inputs = (_dequantized(q8, qs), _dequantized(k8, ks), _dequantized(v8, vs))
        bound = None
        for causal in (False, True):
            out = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, causal=causal)
            ref, _ = attention_ref(*ref_inputs, causal=causal)
            emu, _ = emulate(q8.cpu(), k8.cpu(), v8.cpu(), qs.cpu(), ks.cpu(), vs.cpu(),
                             causal=causal, block=None)
            k_rmse, k_max = _errors(out, ref)
            e_rmse, e_max = _errors(emu, ref.cpu())
            bound = max(bound or 0.0, e_rmse)
            rows.append(dict(hdim=f"{d}/{dv}", case="causal" if causal else "plain",
                             rmse=k_rmse, max=k_max, emu_rmse=e_rmse, emu_max=e_max,
                             ok=k_rmse <= 1.25 * e_rmse and k_max <= 1.25 * e_max))
        rows += _feature_rows(d, dv, q8, k8, v8, q_desc, ks, vs, ref_inputs, bound)
        rows += _block_rows(d, dv)
    return rows


def _block_rows(d, dv) -> list:
    """Block scales (one per 128 tokens of a head), plain and causal, against the emulation
    with the same scales."""
    from flash_cute.fp8 import dequantize_fp8

    g = torch.Generator(device="cuda").manual_seed(1)
    x = [torch.randn(2, s, n, e, device="cuda", generator=g)
         for s, n, e in ((1000, 8, d), (1037, 2, d), (1037, 2, dv))]
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in x)
    ref_inputs = [dequantize_fp8(t, sc) for t, sc in ((q8, qs), (k8, ks), (v8, vs))]
    rows = []
    for causal in (False, True):
        out = flash_attn_fp8(q8, k8, v8, qs, ks, vs, causal=causal)
        ref, _ = attention_ref(*ref_inputs, causal=causal)
        emu, _ = emulate(q8.cpu(), k8.cpu(), v8.cpu(), qs.cpu(), ks.cpu(), vs.cpu(),
                         causal=causal)
        k_rmse, k_max = _errors(out, ref)
        e_rmse, e_max = _errors(emu, ref.cpu())
        rows.append(dict(hdim=f"{d}/{dv}", case="block scales" + (" causal" if causal else ""),
                         rmse=k_rmse, max=k_max, emu_rmse=e_rmse, emu_max=e_max,
                         ok=k_rmse <= 1.25 * e_rmse and k_max <= 1.25 * e_max))
    return rows


def _feature_rows(d, dv, q8, k8, v8, q_desc, ks, vs, ref_inputs, bound) -> list:
    """The features, each against float64 and held to its own emulation (the CPU path of
    the same call, `flash_attn_fp8` on CPU copies)."""
    rows = []
    sk = k8.shape[1]
    used = torch.tensor([sk, sk - 300], dtype=torch.int32, device="cuda")
    cases = {"local+softcap": dict(window_size=(100, 50), softcap=15.0),
             "packed GQA causal": dict(causal=True, pack_gqa=True),
             "seqused_k causal": dict(causal=True, seqused_k=used)}
    for name, kw in cases.items():
        out = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, **kw)
        cpu_kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        emu = flash_attn_fp8(*(t.cpu() for t in (q8, k8, v8, q_desc, ks, vs)), **cpu_kw)
        ref_kw = {n: t for n, t in kw.items() if n != "pack_gqa"}
        ref, _ = attention_ref(*ref_inputs, **ref_kw)
        k_rmse, k_max = _errors(out, ref)
        e_rmse, e_max = _errors(emu, ref.cpu())
        rows.append(dict(hdim=f"{d}/{dv}", case=name, rmse=k_rmse, max=k_max, emu_rmse=e_rmse,
                         emu_max=e_max, ok=k_rmse <= 1.25 * e_rmse and k_max <= 1.25 * e_max))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "accuracy": accuracy()}
    for r in result["accuracy"]:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
