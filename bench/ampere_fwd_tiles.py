"""Ablation: the Ampere forward's (tile_m, tile_n, warps) on the GPU at hand, next to SDPA-flash.

    python bench/ampere_fwd_tiles.py [--hdim 64,128] [--seqlen 2048,8192]

Prints TFLOP/s (4·b·h·s²·d, ÷2 causal) per tile config; results go into docs/perf.md by hand.
"""

import argparse

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cute.arch.ampere import planner as api
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.bench.report import markdown_table

CANDIDATES = {
    64: [(128, 128, 8), (128, 64, 8), (128, 64, 4), (64, 128, 4), (128, 128, 4)],
    128: [(128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4), (128, 64, 4), (128, 32, 4)],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--schedules", "--tiles", dest="schedules", default=None,
                   help="e.g. 128x32x4,64x128x4 (default: all candidates)")
    args = p.parse_args()
    rows = []
    for hdim in map(int, args.hdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            batch, nheads = 16384 // seqlen, 2048 // hdim
            for causal in (False, True):
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda",
                                       dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref_fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                    ref = ref_fn().transpose(1, 2)
                    ms = triton.testing.do_bench(ref_fn, return_mode="median")
                rows.append((hdim, seqlen, causal, "sdpa_flash", flops / ms / 1e9, 0.0))
                problem = validate_attention_inputs(q, k, v, causal=causal)
                tiles = CANDIDATES[hdim] if not args.schedules else [
                    tuple(map(int, t.split("x"))) for t in args.schedules.split(",")]
                for tile in tiles:
                    fn = lambda: api.forward(q, k, v, problem, schedule=tile)  # noqa: E731
                    err = (fn()[0].float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    rows.append((hdim, seqlen, causal, "x".join(map(str, tile)), flops / ms / 1e9,
                                 err))
                    print(rows[-1], flush=True)
    header = ["hdim", "seqlen", "causal", "config", "TFLOP/s", "max err vs sdpa"]
    print("\n" + markdown_table(header, [[str(r[0]), str(r[1]), str(int(r[2])), r[3],
                                           f"{r[4]:.1f}", f"{r[5]:.1e}"] for r in rows]))


if __name__ == "__main__":
    main()
