"""Decode's GPU time with the L2 cold, per provider: a CUDA graph of the call alone (L2 warm
from the call before), and of a flush then the call (less the flush), the flush by writes as
triton's `do_bench` does (dirty lines the call's reads must write back) or by reads (clean
lines). What `bench decode` measures at b = 1, where a cell's bytes are few, without the host.
Usage: python bench/decode_cold.py [--cells 1x8192,1x32768,1x131072,8x32768] [--queries 1]"""

import argparse

import torch
import triton.testing

from flash_cute.tools.bench_decode import (
    HDIM,
    HEADS,
    HEADS_KV,
    _calls,
    cache_bytes,
    cold_graph_ms,
    gbps,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1x8192,1x32768,1x131072,8x32768")
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--providers", default="flash_cute,cudnn")
    args = ap.parse_args()
    print("| b x L | provider | warm graph | cold, write flush | cold, read flush |")
    print("|---|---|---:|---:|---:|")
    for cell in args.cells.split(","):
        b, seqlen = map(int, cell.split("x"))
        q = torch.randn(b, args.queries, HEADS, HDIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, seqlen, HEADS_KV, HDIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = cache_bytes(b, seqlen)
        calls, _ = _calls(q, k, v, None)
        for name in args.providers.split(","):
            fn = calls[name]
            fn()
            times = [triton.testing.do_bench_cudagraph(fn, rep=50), cold_graph_ms(fn, "write"),
                     cold_graph_ms(fn, "read")]
            print(f"| {b} x {seqlen // 1024}k | {name} | "
                  + " | ".join(f"{t * 1e3:.1f} us ({gbps(nbytes, t):,.0f})" for t in times)
                  + " |")


if __name__ == "__main__":
    main()
