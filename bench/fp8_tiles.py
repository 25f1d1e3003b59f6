"""The FP8 forward's key-tile ablation: per-head descales at several tile_n (the schedule
table patched in this process only), our bf16 forward beside them, interleaved rounds.
    python bench/fp8_tiles.py [--tiles 128:128,192,224 --tiles 256:64,128] [--rounds 3]
Prints TFLOP/s (4·b·h·s²·d, halved when causal) per cell; 16k tokens a cell."""
import argparse

import torch

import flash_cute
from flash_cute.arch.hopper import config
from flash_cute.fp8 import quantize_fp8
from flash_cute.tools.bench.measure import interleaved_times, make_timer
from flash_cute.tools.bench_fp8 import TOKENS, tflops


def fp8_call(qkv, causal, hdim, tile_n):
    base = config.FP8_SCHEDULES[hdim]

    def call():
        saved = config.FP8_SCHEDULES[hdim]
        config.FP8_SCHEDULES[hdim] = base._replace(tile_n=tile_n)
        try:
            return flash_cute.flash_attn_func(*(t for t, _ in qkv), causal=causal,
                                              q_descale=qkv[0][1], k_descale=qkv[1][1],
                                              v_descale=qkv[2][1])
        finally:
            config.FP8_SCHEDULES[hdim] = saved
    return call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", action="append", default=None)
    p.add_argument("--seqlens", default="8192,16384")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tiles = {int(h): [int(t) for t in ts.split(",")]
             for h, ts in (x.split(":") for x in (a.tiles or ["128:128,192,224", "256:64,128"]))}
    timer = make_timer(25, 100)
    print(torch.cuda.get_device_name())
    for hdim, tile_ns in tiles.items():
        for seqlen in (int(s) for s in a.seqlens.split(",")):
            for causal in (False, True):
                batch, heads = TOKENS // seqlen, 16 if hdim == 128 else 8
                x = [torch.randn(batch, seqlen, heads, hdim, device="cuda",
                                 dtype=torch.bfloat16) for _ in range(3)]
                qkv = [quantize_fp8(t, block=None) for t in x]
                fns = {f"fp8 n{t}": fp8_call(qkv, causal, hdim, t) for t in tile_ns}
                fns["bf16"] = lambda: flash_cute.flash_attn_func(*x, causal=causal)  # noqa: B023
                ref = fns["bf16"]()[0].float()
                # A broken tile shows as an RMSE far from the others' (FP8 against bf16).
                errs = "  ".join(f"{n} {(fn()[0].float() - ref).pow(2).mean().sqrt().item():.2e}"
                                 for n, fn in fns.items() if n != "bf16")
                print(f"hd {hdim} s {seqlen} causal {int(causal)} rmse vs bf16: {errs}")
                times = interleaved_times(fns, a.rounds, timer)
                rates = "  ".join(f"{n} {tflops(batch, heads, seqlen, hdim, causal, t[0]):.0f}"
                                  for n, t in times.items())
                print(f"hd {hdim} s {seqlen} causal {int(causal)}: {rates}", flush=True)


if __name__ == "__main__":
    main()
