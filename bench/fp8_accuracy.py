"""FP8 attention's accuracy on the CPU (`flash_cute.fp8`), no GPU:

1. the emulation of the FP8 forward (`fp8.emulate`) against float64 attention over the
   dequantized inputs, on N(0, 1) inputs at each head dim: RMSE and max error (the bound the
   FP8 kernel is to meet within 1.25x);
2. FA3's method on its outlier distribution, N(0, 1) + N(0, 1)·10·Bernoulli(0.001): per-tensor
   scales without the rotation against block scales (128 tokens) with incoherent processing,
   and with K smoothing too, each against float64 attention over the original inputs (RMSE).
   With --kernel (a Hopper GPU) part 2 runs the FP8 kernel instead of its emulation.

    python bench/fp8_accuracy.py [--seqlen 1024] [--heads 4] [--hdims 64,128,256] [--kernel]"""

import argparse

import torch

from flash_cute.fp8 import dequantize_fp8, emulate, flash_attn_fp8, incoherent, quantize_fp8
from flash_cute.reference.attention import attention_ref


def quantized_run(q, k, v, block, rotate, smooth=False, causal=False):
    """The emulation's output (CPU tensors) or the FP8 kernel's (CUDA ones) for q, k, v
    quantized per block (128) or per tensor (None)."""
    if rotate:
        q, k = incoherent(q, k, seed=1)
    q8, qs = quantize_fp8(q, block)
    k8, ks = quantize_fp8(k, block, smooth_k=smooth)
    v8, vs = quantize_fp8(v, block)
    if q.is_cuda:
        return flash_attn_fp8(q8, k8, v8, qs, ks, vs, causal=causal).cpu()
    return emulate(q8, k8, v8, qs, ks, vs, causal=causal, block=block)[0]


def outliers(gen, shape):
    """FA3's outlier distribution: N(0, 1) plus, on 0.1 % of the entries, N(0, 1)·10."""
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    spikes = torch.randn(shape, generator=gen, dtype=torch.float64) * 10
    return base + spikes * (torch.rand(shape, generator=gen) < 0.001)


def emulation_error(d: int, seqlen: int, heads: int, causal: bool, seed: int = 0):
    """(RMSE, max error) of the emulation against float64 over the dequantized inputs."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seqlen, heads, d, generator=g) for _ in range(3))
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
    out = emulate(q8, k8, v8, qs, ks, vs, causal=causal)[0].double()
    ref = attention_ref(*(dequantize_fp8(t, s) for t, s in ((q8, qs), (k8, ks), (v8, vs))),
                        causal=causal, mode="float64")[0]
    diff = out - ref
    return diff.pow(2).mean().sqrt().item(), diff.abs().max().item()


def method_errors(d: int, seqlen: int, heads: int, seed: int = 0, device="cpu") -> dict:
    """RMSE against float64 over the original inputs: per tensor, block + incoherent, and
    block + incoherent + K smoothing (`device` "cuda": the kernel's)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (outliers(g, (1, seqlen, heads, d)) for _ in range(3))
    ref = attention_ref(q, k, v, mode="float64")[0]
    q, k, v = (t.float().to(device) for t in (q, k, v))

    def rmse(out):
        return (out.double() - ref).pow(2).mean().sqrt().item()
    return {"per-tensor": rmse(quantized_run(q, k, v, None, False)),
            "block + incoherent": rmse(quantized_run(q, k, v, 128, True)),
            "+ K smoothing": rmse(quantized_run(q, k, v, 128, True, smooth=True))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--kernel", action="store_true", help="part 2 by the FP8 kernel (CUDA)")
    args = ap.parse_args()
    hdims = [int(x) for x in args.hdims.split(",")]
    if not args.kernel:
        print("| hdim | causal | emulation RMSE | emulation max error |")
        print("|---:|---|---:|---:|")
        for d in hdims:
            for causal in (False, True):
                r, m = emulation_error(d, args.seqlen, args.heads, causal)
                print(f"| {d} | {causal} | {r:.3e} | {m:.3e} |")
        print()
    else:
        print(torch.cuda.get_device_name())
    print("| hdim | per-tensor | block + incoherent | + K smoothing | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for d in hdims:
        e = method_errors(d, args.seqlen, args.heads,
                          device="cuda" if args.kernel else "cpu")
        ratio = e["per-tensor"] / e["block + incoherent"]
        print(f"| {d} | {e['per-tensor']:.3e} | {e['block + incoherent']:.3e} | "
              f"{e['+ K smoothing']:.3e} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
