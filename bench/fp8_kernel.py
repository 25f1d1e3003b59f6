"""The FP8 forward on a Hopper GPU: its error against float64 of the dequantized inputs, beside
the CPU emulation's (the kernel is held to 1.25x of it, per config), and its speed beside our
bf16 forward and the card's FP8 ceiling (`torch._scaled_mm`, 8192³ e4m3), in one run.

    python bench/fp8_kernel.py [--accuracy] [--speed] [--json PATH]

Accuracy: N(0, 1) inputs quantized per (batch, K/V head) (FA3's descales), odd lengths, GQA;
plain and causal at every head dim against the emulation; local + softcap, varlen + seqused_k
and packed GQA against float64 only (the emulation has no masks beyond causal), held to the
same head dim's emulation error. Speed: TFLOP/s by 4·b·h·sq·sk·d (causal halved), triton's
do_bench with the L2 flushed, FP8 and bf16 interleaved.
"""

import argparse
import json
import math

import torch

from flash_cute.fp8 import quantize_fp8
from flash_cute.fp8.attention import flash_attn_fp8, fp8_tflops
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
    """Features the emulation lacks, against float64, held to the head dim's emulation RMSE."""
    rows = []
    cases = {"local+softcap": dict(window_size=(100, 50), softcap=15.0),
             "packed GQA causal": dict(causal=True, pack_gqa=True)}
    for name, kw in cases.items():
        out = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, **kw)
        ref, _ = attention_ref(*ref_inputs, causal=kw.get("causal", False),
                               window_size=kw.get("window_size", (None, None)),
                               softcap=kw.get("softcap", 0.0))
        rmse, mx = _errors(out, ref)
        rows.append(dict(hdim=f"{d}/{dv}", case=name, rmse=rmse, max=mx, emu_rmse=bound,
                         emu_max=None, ok=rmse <= 1.25 * bound))
    # Varlen with seqused_k: two sequences packed, the second using part of its keys.
    b, sq, h = q8.shape[:3]
    sk = k8.shape[1]
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
    used = torch.tensor([sk, sk - 300], dtype=torch.int32, device="cuda")
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q8, k8, v8)]
    out = flash_attn_fp8(*flat, q_desc, ks, vs, causal=True, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk, seqused_k=used)
    ref, _ = attention_ref(*(t.reshape(-1, *t.shape[2:]) for t in ref_inputs), causal=True,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used)
    rmse, mx = _errors(out, ref)
    rows.append(dict(hdim=f"{d}/{dv}", case="varlen+seqused_k causal", rmse=rmse, max=mx,
                     emu_rmse=bound, emu_max=None, ok=rmse <= 1.25 * bound))
    return rows


def speed() -> list:
    import triton.testing

    import flash_cute

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    bt = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, bt, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16))
    rows = [dict(case="ceiling _scaled_mm 8192^3 e4m3", tflops=2 * 8192 ** 3 / ms / 1e9)]
    for d in (128, 256):
        for seqlen in (8192, 16384):
            for causal in (False, True):
                b, h = 16384 // seqlen, 16 if d == 128 else 8
                x = [torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(3)]
                x8 = [_quantize_q(x[0], h), _quantize(x[1]), _quantize(x[2])]
                desc = [s for _, s in x8]
                times = {"fp8": [], "bf16": []}
                for _ in range(3):
                    times["fp8"].append(bench(lambda: flash_attn_fp8(
                        *(t for t, _ in x8), *desc, causal=causal)))
                    times["bf16"].append(bench(lambda: flash_cute.flash_attn_func(
                        *x, causal=causal)))
                rates = {k: fp8_tflops(b, h, seqlen, seqlen, d, causal,
                                       sorted(v)[1] / 1e3) for k, v in times.items()}
                rows.append(dict(case=f"hd{d} {seqlen // 1024}k {'causal' if causal else ''}",
                                 tflops=rates["fp8"], bf16=rates["bf16"],
                                 ratio=rates["fp8"] / rates["bf16"],
                                 of_ceiling=rates["fp8"] / rows[0]["tflops"]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    parts = {"accuracy": args.accuracy or not args.speed, "speed": args.speed or not
             args.accuracy}
    result = {"gpu": torch.cuda.get_device_name()}
    if parts["accuracy"]:
        result["accuracy"] = accuracy()
        for r in result["accuracy"]:
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in r.items()), flush=True)
    if parts["speed"]:
        result["speed"] = speed()
        for r in result["speed"]:
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
