"""Spread of one backward cell's time, within a process and across fresh allocations.

    python bench/bwd_spread.py [--hdim 128] [--seqlen 2048] [--causal 1] [--rounds 6]
                               [--calls 20] [--arch hopper]

Some cells (the 2k causal backward) have measured up to 2x apart between runs of the same
code (session 10 in docs/archive/perf-log-2026-11.md). This separates the candidates: each round
allocates new inputs (new addresses), then times `--calls` backward calls one by one with CUDA
events (autograd through `flash_attn_func`, as `bench` times it). A spread inside a round points at
the kernel's own run-to-run behaviour (scheduling, contention); rounds that differ from each
other while each is tight point at the placement of the buffers. Unlike `bench`, L2 is not
flushed between calls.
"""

import argparse
import statistics

import torch

from flash_cute import flash_attn_func
from flash_cute.tools.bench.measure import attention_flops, tflops_per_s


def one_round(batch, seqlen, nheads, hdim, causal, arch, calls):
    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    out, _ = flash_attn_func(q, k, v, causal=causal, arch=arch)

    def grads():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    grads()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, q.data_ptr()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--arch", default=None, help="pipeline (default: the library's choice)")
    args = p.parse_args()
    batch, nheads = 16384 // args.seqlen, 2048 // args.hdim
    flops = attention_flops(batch, nheads, args.seqlen, args.seqlen, args.hdim,
                            causal=bool(args.causal), direction="bwd")
    print(f"hdim {args.hdim}, seqlen {args.seqlen}, batch {batch}, heads {nheads}, "
          f"causal {args.causal}: TFLOP/s per call")
    print("| round | q address | min | median | max |")
    print("|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        times, addr = one_round(batch, args.seqlen, nheads, args.hdim, bool(args.causal),
                                args.arch, args.calls)
        tflops = sorted(tflops_per_s(flops, t) for t in times)
        print(f"| {r} | {addr:#x} | {tflops[0]:.1f} | {statistics.median(tflops):.1f} "
              f"| {tflops[-1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
