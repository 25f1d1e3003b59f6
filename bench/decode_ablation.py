"""Decode ablations on the hopper forward, in GB/s of K+V read (triton do_bench, L2 flushed),
through `flash_attn_with_kvcache` as `bench decode` calls it: the default plan against
variants of it, in interleaved rounds (each round builds every variant's plan afresh).

Variants: `base` (the default: `config.DECODE_PAIR` where the planner's
`takes_decode_pair` says so); `one` (the head dim's own schedule, one CTA per SM: the
default before the pair); `stages3` (three K/V stages instead of two: at hdim 128 a 128-row
tile with three stages fits 231,424 B of shared memory); `x2` / `half` (twice /
half the heuristic's split count); `nosplit` (num_splits 1); `cta2` (`config.DECODE_PAIR`:
64-row tiles, one consumer warpgroup, 64-key blocks, two CTAs per SM, the heuristic's splits
for that occupancy).

Each cell prints the median GB/s of the rounds, and the rounds' range beneath it.

Usage: python bench/decode_ablation.py [--cells 1x8192,1x32768] [--pages 0,16] [--rounds 3]
       [--variants base,one]
"""

import argparse

import torch

from flash_cute.api.kvcache import flash_attn_with_kvcache
from flash_cute.arch.hopper import planner as hopper_api
from flash_cute.arch.hopper.config import DECODE_PAIR
from flash_cute.runtime import plans, splits
from flash_cute.tools.bench.measure import make_timer
from flash_cute.tools.bench_decode import HDIM, HEADS, HEADS_KV, _paged, cache_bytes, gbps

VARIANTS = ("base", "one", "stages3", "x2", "half", "nosplit", "cta2")


class _Override:
    """Patches the planners for one variant while a plan is built."""

    def __init__(self):
        self.fwd_schedule = hopper_api.fwd_schedule
        self.plan_splits = hopper_api.plan_splits
        self.picked = {}

    def set(self, variant: str):
        base_schedule, base_splits = self.fwd_schedule, self.plan_splits

        def schedule(*a, **kw):
            if variant == "one":
                a, kw = a[:5], {**kw, "decode": False}
            s = base_schedule(*a, **kw)
            if variant == "cta2":
                return DECODE_PAIR
            return s._replace(kv_stages=3) if variant == "stages3" else s

        def plan(*a, **kw):
            sp = base_splits(*a, **kw)
            if sp is not None and variant in ("x2", "half"):
                count = sp.count * 2 if variant == "x2" else max(sp.count // 2, 2)
                sp = splits.Splits(min(count, splits.MAX_SPLITS), sp.blocks_per_split)
            self.picked[variant] = sp.count if sp is not None else 1
            return sp

        hopper_api.fwd_schedule, hopper_api.plan_splits = schedule, plan
        plans.clear_plans()

    def reset(self):
        hopper_api.fwd_schedule, hopper_api.plan_splits = self.fwd_schedule, self.plan_splits
        plans.clear_plans()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1x8192,1x32768,1x131072,8x32768")
    ap.add_argument("--pages", default="0,16,64")
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    timer = make_timer(25, 100)
    override = _Override()
    print("| b x L | page | " + " | ".join(variants) + " | splits |")
    print("|---|---|" + "---:|" * (len(variants) + 1))
    for cell in args.cells.split(","):
        b, seqlen = map(int, cell.split("x"))
        q = torch.randn(b, args.queries, HEADS, HDIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, seqlen, HEADS_KV, HDIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
        for page in map(int, args.pages.split(",")):
            kc, vc, table = (k, v, None) if page == 0 else _paged(k, v, page)
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name in variants:
                    override.set(name)
                    # Bound as defaults: the caches are deleted below, page size by page size.
                    def fn(n=name, q=q, kc=kc, vc=vc, table=table):
                        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                       block_table=table,
                                                       num_splits=1 if n == "nosplit" else 0)
                    fn()
                    times[name].append(timer(fn))
                    override.reset()
            nbytes = cache_bytes(b, seqlen)
            rates = [gbps(nbytes, sorted(t)[len(t) // 2]) for t in times.values()]
            spread = [f"{gbps(nbytes, max(t)):,.0f}-{gbps(nbytes, min(t)):,.0f}"
                      for t in times.values()]
            picked = "/".join(str(override.picked.get(n, 1)) for n in variants)
            print(f"| {b} x {seqlen // 1024}k | {page or 'dense'} | "
                  + " | ".join(f"{r:,.0f}" for r in rates) + f" | {picked} |", flush=True)
            print("| | range | " + " | ".join(spread) + " | |", flush=True)
            del fn, kc, vc, table
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
