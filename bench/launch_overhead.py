"""Host time of one call: what a tiny problem costs when the GPU has nothing to do.

    python bench/launch_overhead.py [--calls 300] [--arch hopper] [--profile 25]
                                    [--profile-call fwd|fwd_bwd]

Short sequences are bound by the host: at seqlen 512 (batch 32) the forward ran at the same
~260 us per call whatever the head dim or mask (session 11, docs/archive/perf-log-2026-11.md).
This times `flash_attn_func` forward and forward + backward on a 1 x 128 x 1 x 64 problem (and
FA4's, when flash_attn.cute imports), calls back to back without synchronizing (the GPU work is a
few microseconds, so the wall time per call is the host's), and with `--profile N` prints the N
functions with the most cumulative time in a profiled run of the forward (`--profile-call fwd_bwd`:
of both).
"""

import argparse
import cProfile
import pstats
import time

import torch

from flash_cute import flash_attn_func


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--arch", default=None, help="pipeline (default: the library's choice)")
    p.add_argument("--profile", type=int, default=0, help="print this many profiled functions")
    p.add_argument("--profile-call", choices=("fwd", "fwd_bwd"), default="fwd")
    args = p.parse_args()
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    kw = {} if args.arch is None else {"arch": args.arch}

    def fwd():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True, **kw)

    def fwd_bwd():
        out, _ = flash_attn_func(q, k, v, causal=True, **kw)
        torch.autograd.grad(out, (q, k, v), dout)

    rows = [("flash_cute", "forward", fwd), ("flash_cute", "forward + backward", fwd_bwd)]
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    if fa4 is not None:
        def fa4_fwd():
            with torch.no_grad():
                fa4(q, k, v, causal=True)

        def fa4_fwd_bwd():
            out = fa4(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, (q, k, v), dout)

        rows += [("fa4", "forward", fa4_fwd), ("fa4", "forward + backward", fa4_fwd_bwd)]
    print("| library | call | host us per call |\n|---|---|---:|")
    for lib, call, fn in rows:
        print(f"| {lib} | {call} | {per_call_us(fn, args.calls):.1f} |")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        call = fwd if args.profile_call == "fwd" else fwd_bwd
        for _ in range(args.calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
