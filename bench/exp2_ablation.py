"""The forwards with the software exp2 (`flash_cute.blocks.exp2_emu`) on and off, in one run:
TFLOP/s (4·b·h·s²·d, ÷2 causal) of each share, the median of `--rounds` interleaved rounds
with their spread, and the largest |O| difference from the share-0 forward.

    python bench/exp2_ablation.py [--arch hopper] [--hdim 128] [--seqlen 8192] [--causal 0,1]
                                  [--shares 0,2,4]

Each share's launch is planned once with FLASH_CUTE_EX2_EMULATION set to share/16 and then
called directly, so the timed calls do not touch the switch.
"""

import argparse
import os

import torch

from flash_cute.contract.variant import EX2_EMULATION_ENV
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.bench.measure import ablation_rows, make_timer
from flash_cute.tools.bench.report import ablation_table


def planned(api, q, k, v, problem, per16: int):
    """A no-argument call of the arch's forward launch planned with `per16` of 16 emulated."""
    before = os.environ.get(EX2_EMULATION_ENV)
    os.environ[EX2_EMULATION_ENV] = str(per16 / 16)
    try:
        launch = api.plan_forward(q, k, v, problem)
    finally:
        if before is None:
            os.environ.pop(EX2_EMULATION_ENV)
        else:
            os.environ[EX2_EMULATION_ENV] = before
    return lambda: launch(q, k, v)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="hopper", choices=("hopper", "ampere"))
    p.add_argument("--hdim", default="128")
    p.add_argument("--seqlen", default="8192")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--shares", default="0,2,4", help="emulated values per 16")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.arch == "hopper":
        from flash_cute.arch.hopper import planner as api
    else:
        from flash_cute.arch.ampere import planner as api
    timer = make_timer(25, 100)
    rows = []
    for hdim in map(int, args.hdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in map(bool, map(int, args.causal.split(","))):
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                       dtype=torch.bfloat16) for _ in range(3))
                problem = validate_attention_inputs(q, k, v, causal=causal)
                fns = {f"ex2 {s}/16": planned(api, q, k, v, problem, s)
                       for s in map(int, args.shares.split(","))}
                ref = next(iter(fns.values()))()[0].float()
                errs = {n: f"{(f()[0].float() - ref).abs().max().item():.1e}"
                        for n, f in fns.items()}
                flops = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                rows += ablation_rows((hdim, seqlen, int(causal)), fns, errs, flops,
                                      args.rounds, timer)
    print("\n" + ablation_table(rows, f"{args.arch} fwd TFLOP/s", "max |O| diff vs 0/16"))


if __name__ == "__main__":
    main()
