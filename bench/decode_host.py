"""Host time of one decode call, by function (cProfile over many calls, launches queued
behind a spin so the GPU never waits for them): where the host time of
`flash_attn_with_kvcache` and `flash_attn_varlen_func` goes.
Usage: python bench/decode_host.py [--calls 300] [--top 25]"""

import argparse
import cProfile
import pstats
import time

import torch

from flash_cute import flash_attn_varlen_func
from flash_cute.kvcache import flash_attn_with_kvcache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    calls = {
        "with_kvcache": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
        "varlen_split": lambda: flash_attn_varlen_func(q, k, v, seqused_k=lens, num_splits=0),
        "varlen_nosplit": lambda: flash_attn_varlen_func(q, k, v, seqused_k=lens),
    }
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {name}: {host:.1f} us per call (no profiler)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
