"""One forward and one backward of a pipeline (or of FA4), for `ncu` (see docs/perf.md).

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 0 --section SpeedOfLight \\
        python bench/profile_pass.py --arch hopper --hdim 128 --seqlen 8192 [--fa4]

The shapes are the bench grid's (16k tokens, nheads = 2048 / hdim). The first call compiles;
the kernels of the second are the ones to profile (`--launch-skip` past the first).
"""

import argparse

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="hopper", help="our pipeline (ignored with --fa4)")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fa4", action="store_true", help="run flash-attn-4 instead of ours")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    args = p.parse_args()
    if args.fa4:
        from flash_attn.cute import flash_attn_func

        def attend(q, k, v):
            return flash_attn_func(q, k, v, causal=args.causal)
    else:
        from flash_cute import flash_attn_func

        def attend(q, k, v):
            return flash_attn_func(q, k, v, causal=args.causal, arch=args.arch)
    batch, heads = 16384 // args.seqlen, 2048 // args.hdim
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=args.direction != "fwd")
               for _ in range(3))
    for _ in range(2):
        out = attend(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        if args.direction != "fwd":
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
