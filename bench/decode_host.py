"""Host time of one decode call (1 x 8k, whose GPU time is a fraction of its host time, so a
loop of calls measures the host), then by function (cProfile): where the host time of
`flash_attn_with_kvcache` and `flash_attn_varlen_func` goes.
The appending calls (one new row into a 1 x 8k cache, the kernel's append) run with the
torch writers' dropped-rows count and without it (`status.count_dropped` and
`paging.append_fits` replaced by no-ops for that call only), interleaved. The kernel counts
its own drops (`blocks.kv_append.count_dropped`), so on its path the two should match: a
difference is host time the status word adds to a decode step.
Usage: python bench/decode_host.py [--calls 300] [--rounds 5] [--top 25]"""

import argparse
import cProfile
import pstats
import time

import torch

from flash_cute import flash_attn_varlen_func
from flash_cute.api.kvcache import flash_attn_with_kvcache
from flash_cute.runtime import paging, status


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=5)
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
    cache_k, cache_v = torch.zeros_like(k), torch.zeros_like(v)
    k_new, v_new = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    before = torch.full((1,), 8191, dtype=torch.int32, device="cuda")

    def append():
        return flash_attn_with_kvcache(q, cache_k, cache_v, k_new, v_new, cache_seqlens=before)

    def append_uncounted():
        saved = status.count_dropped, paging.append_fits
        status.count_dropped, paging.append_fits = (lambda fits: None), (lambda *a, **k: None)
        try:
            return append()
        finally:
            status.count_dropped, paging.append_fits = saved
    calls.update(append_counted=append, append_uncounted=append_uncounted)
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    # Rounds interleaved across the calls: the host's speed drifts, and interleaving makes
    # the calls share each drift.
    host = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
    for name, fn in calls.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        times = sorted(host[name])
        print(f"== {name}: {times[len(times) // 2]:.1f} us per call, median of {args.rounds} "
              f"rounds (min {times[0]:.1f}, max {times[-1]:.1f}; no profiler)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)

if __name__ == "__main__":
    main()
