"""`python -m flash_cute bench fp8`: the FP8 forward's TFLOP/s beside our bf16 forward and the
card's FP8 ceiling, in one run.

The ceiling is `torch._scaled_mm` on 8192³ e4m3 (2·8192³ FLOP per call). Cells: hdim 128
(16 heads) and 256 (8 heads), 8k and 16k tokens per sequence with 16k tokens in the batch,
causal and not; providers interleaved per cell (`measure.interleaved_times`):

* fp8: `flash_attn_func` on e4m3 q, k, v with FA3's descales (the Hopper FP8 kernel);
* fp8_block: the same with block scales (one per 128 tokens of a head);
* bf16: our bf16 forward on the same problem.

TFLOP/s by the standard count 4·b·h·sq·sk·d, halved when causal; the median of the rounds.
cuDNN's FP8 attention is not in torch's SDPA; where it is installed, its place is a provider
here (none is on the project's GPU host).
"""

import json
import os
import sys
import time

CELLS = tuple((d, s, c) for d in (128, 256) for s in (8192, 16384) for c in (False, True))
TOKENS = 16384
CEILING_N = 8192


def tflops(batch: int, heads: int, seqlen: int, hdim: int, causal: bool, ms: float) -> float:
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def ceiling(timer) -> float:
    """TFLOP/s of `torch._scaled_mm` on CEILING_N³ e4m3 (bf16 out)."""
    import torch

    a = torch.randn(CEILING_N, CEILING_N, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(CEILING_N, CEILING_N, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16))
    return 2 * CEILING_N ** 3 / (ms * 1e-3) / 1e12


def _providers(hdim: int, seqlen: int, causal: bool) -> tuple:
    """(batch, heads, {name: callable}) of one cell."""
    import torch

    import flash_cute
    from flash_cute.fp8 import quantize_fp8

    batch, heads = TOKENS // seqlen, 16 if hdim == 128 else 8
    x = [torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
         for _ in range(3)]
    per_head = [quantize_fp8(t, block=None) for t in x]
    blocks = [quantize_fp8(t) for t in x]
    # FA3's q_descale is per K/V head: here every head is its own (no GQA), so per head.
    fns = {
        "fp8": lambda: flash_cute.flash_attn_func(
            *(t for t, _ in per_head), causal=causal, q_descale=per_head[0][1],
            k_descale=per_head[1][1], v_descale=per_head[2][1]),
        "fp8_block": lambda: flash_cute.flash_attn_func(
            *(t for t, _ in blocks), causal=causal, q_descale=blocks[0][1],
            k_descale=blocks[1][1], v_descale=blocks[2][1]),
        "bf16": lambda: flash_cute.flash_attn_func(*x, causal=causal),
    }
    return batch, heads, fns


def run(args) -> int:
    import torch

    from flash_cute.tools.bench.measure import interleaved_times, make_timer

    if not torch.cuda.is_available():
        print("bench fp8 needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    timer = make_timer(args.warmup, args.rep)
    out_dir = args.out or os.path.join("results", f"bench-fp8-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out_dir, exist_ok=True)
    record = {"gpu": torch.cuda.get_device_name(), "ceiling_tflops": ceiling(timer),
              "cells": []}
    print(f"{record['gpu']}: FP8 ceiling (_scaled_mm {CEILING_N}^3) "
          f"{record['ceiling_tflops']:.0f} TFLOP/s")
    print("| hdim | seqlen | causal | fp8 | fp8_block | bf16 | fp8 / bf16 | fp8 / ceiling |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for hdim, seqlen, causal in CELLS:
        batch, heads, fns = _providers(hdim, seqlen, causal)
        times = interleaved_times(fns, args.rounds, timer)
        rate = {n: tflops(batch, heads, seqlen, hdim, causal, t[0]) for n, t in times.items()}
        record["cells"].append(dict(hdim=hdim, seqlen=seqlen, causal=causal, tflops=rate,
                                    times_ms=times))
        print(f"| {hdim} | {seqlen} | {'yes' if causal else 'no'} | {rate['fp8']:.0f} | "
              f"{rate['fp8_block']:.0f} | {rate['bf16']:.0f} | "
              f"{rate['fp8'] / rate['bf16']:.2f} | "
              f"{rate['fp8'] / record['ceiling_tflops']:.2f} |", flush=True)
        del fns
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "bench_fp8.json"), "w") as f:
        json.dump(record, f, indent=1)
    return 0
