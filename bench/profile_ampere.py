"""One forward and one backward of the Ampere pipeline, for `ncu` (see docs/perf.md).

    ncu --clock-control none -k regex:kernel_cutlass --section SpeedOfLight ... \\
        python bench/profile_ampere.py --hdim 128 --seqlen 8192
"""

import argparse

import torch

from flash_cute import flash_attn_func


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    batch, heads = 16384 // args.seqlen, 2048 // args.hdim
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(2):  # the first call compiles; the second is the one to profile
        out, _ = flash_attn_func(q, k, v, causal=args.causal, arch="ampere")
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
