"""Where a decode call's time goes: per-kernel GPU time (torch.profiler), the call's GPU time
under a CUDA graph (no host), the same with the L2 flushed before each call (a graph of flush +
call, less a graph of the flush alone), its do_bench time with the L2 flushed, and its host
time, for several split counts, through `flash_attn_with_kvcache` (dense, or paged at `--pages`).
Usage: python bench/decode_profile.py [--cells 1x8192,1x32768] [--pages 0,64]"""

import argparse
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from flash_cute.api.kvcache import flash_attn_with_kvcache
from flash_cute.tools.bench_decode import _paged, cold_graph_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1x8192,1x32768,1x131072")
    ap.add_argument("--splits", default="0,1,8,16,32,64")
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--pages", default="0", help="page sizes, 0: the dense cache")
    args = ap.parse_args()
    for cell in args.cells.split(","):
        b, L = map(int, cell.split("x"))
        q = torch.randn(b, args.queries, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, L, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        used = torch.full((b,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * k.numel() * 2
        for page, s in ((p, s) for p in map(int, args.pages.split(","))
                        for s in map(int, args.splits.split(","))):
            kc, vc, table = (k, v, None) if page == 0 else _paged(k, v, page)
            fn = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used,  # noqa
                                                 block_table=table, num_splits=s)
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            kern = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.count:
                    kern[e.key[:60]] = (e.count, e.device_time_total / e.count)
            graph_ms = triton.testing.do_bench_cudagraph(fn, rep=50)
            cold_ms = cold_graph_ms(fn)
            bench_ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{cell} q{args.queries} page {page} splits={s}: graph {graph_ms * 1e3:.1f} us "
                  f"({nbytes / graph_ms / 1e6:,.0f} GB/s), cold graph {cold_ms * 1e3:.1f} us "
                  f"({nbytes / cold_ms / 1e6:,.0f} GB/s), do_bench {bench_ms * 1e3:.1f} us "
                  f"({nbytes / bench_ms / 1e6:,.0f} GB/s), host {host_us:.1f} us")
            for name, (count, us) in sorted(kern.items(), key=lambda x: -x[1][1]):
                print(f"    {us:8.1f} us x{count // 20:<3} {name}")


if __name__ == "__main__":
    main()
