"""Cost of `deterministic=True` in the Hopper backward: TFLOP/s of the default (dQ added in
whatever order CTAs finish) and the deterministic (fixed order, per-query-tile semaphores)
backward through autograd, same inputs, one run.

    python bench/deterministic_bwd.py [--hdim 128] [--seqlen 8192]
"""

import argparse

import torch
import triton.testing

from flash_cute import flash_attn_func


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", default="128")
    p.add_argument("--seqlen", default="8192")
    args = p.parse_args()
    print("| hdim | seqlen | causal | default | deterministic |\n|---:|---:|---:|---:|---:|")
    for hdim in map(int, args.hdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in (False, True):
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                       dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                do = torch.randn_like(q)
                flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                cells = []
                for det in (False, True):
                    out = flash_attn_func(q, k, v, causal=causal, deterministic=det)[0]
                    fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                    cells.append(flops / triton.testing.do_bench(fn, return_mode="median") / 1e9)
                print(f"| {hdim} | {seqlen} | {int(causal)} | {cells[0]:.1f} | {cells[1]:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
