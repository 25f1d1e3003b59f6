"""Packed GQA on the Hopper forward: pack_gqa=True vs False, next to FA4 (which packs GQA by
default) and SDPA (cuDNN and flash, enable_gqa) in the same run, over decode-like and prompt
shapes.

    python bench/gqa_pack.py [--hdim 128] [--shapes 8x1x8192,8x16x8192,8x128x8192,2x4096x4096]
                             [--heads 32:4] [--causal 0,1]

A shape is batch x seqlen_q x seqlen_k; --heads is query heads : K/V heads. Prints µs and
TFLOP/s (4·b·h·sq·sk·d; causal: the visible fraction of bottom-right-aligned pairs) and the
largest |O| difference of each packed/unpacked run from SDPA-flash (from FA4 where SDPA
cannot run the cell) when it exceeds 0.05. SDPA is left out of
causal cells with seqlen_q != seqlen_k: its causal mask is aligned top-left, ours and FA4's
bottom-right.
"""

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cute import flash_attn_func


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    if not causal:
        return sq * sk
    return sum(max(0, min(sk, i + 1 + sk - sq)) for i in range(sq))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdim", default="128")
    ap.add_argument("--shapes", default="8x1x8192,8x16x8192,8x128x8192,2x4096x4096")
    ap.add_argument("--heads", default="32:4")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    h, hk = map(int, args.heads.split(":"))
    providers = {
        "packed": lambda q, k, v, c: flash_attn_func(q, k, v, causal=c, pack_gqa=True)[0],
        "unpacked": lambda q, k, v, c: flash_attn_func(q, k, v, causal=c, pack_gqa=False)[0],
    }
    try:
        from flash_attn.cute import flash_attn_func as fa4

        # flash-attn-4 returns out or (out, lse), by version.
        providers["fa4"] = lambda q, k, v, c: (lambda r: r[0] if isinstance(r, tuple) else r)(
            fa4(q, k, v, causal=c))
    except ImportError as exc:
        print(f"fa4 not importable: {exc}")

    def sdpa(backend):
        def run(q, k, v, c):
            if c and q.shape[1] != k.shape[1]:
                # SDPA's is_causal aligns the mask top-left: another problem than ours.
                raise ValueError("causal with seqlen_q != seqlen_k is top-left aligned in SDPA")
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c,
                    enable_gqa=True).transpose(1, 2)
        return run

    providers["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    providers["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    names = list(providers)
    print(f"heads {h}:{hk}, bf16; cells: µs / TFLOP/s")
    print("| hdim | b x sq x sk | causal | " + " | ".join(names) + " | packed/best peer |")
    print("|---" * (len(names) + 4) + "|")
    for d in map(int, args.hdim.split(",")):
        for shape in args.shapes.split(","):
            b, sq, sk = map(int, shape.split("x"))
            for causal in map(int, args.causal.split(",")):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                flops = 4 * b * h * d * visible_pairs(sq, sk, bool(causal))
                ref = None
                cells, tflops = [], {}
                # References first: SDPA-flash, else (causal with sq != sk) FA4.
                first = [n for n in ("sdpa_flash", "fa4") if n in providers]
                for name in first + [n for n in names if n not in first]:
                    fn = providers[name]
                    try:
                        out = fn(q, k, v, bool(causal))
                        ms = triton.testing.do_bench(lambda: fn(q, k, v, bool(causal)),
                                                     rep=args.rep)
                    except Exception as exc:  # noqa: BLE001 - a peer may not take a shape
                        tflops[name] = None
                        print(f"  {name} {shape} causal={causal}: {type(exc).__name__}: "
                              f"{str(exc)[:120]}")
                        continue
                    if name in first and ref is None:
                        ref = out.float()
                    elif name in ("packed", "unpacked") and ref is not None:
                        diff = (out.float() - ref).abs().max().item()
                        if diff > 0.05:
                            print(f"  {name} {shape} causal={causal}: max |O - sdpa| {diff:.3g}")
                    tflops[name] = (ms * 1e3, flops / ms / 1e9)
                for name in names:
                    t = tflops.get(name)
                    cells.append("—" if t is None else f"{t[0]:.1f} / {t[1]:.0f}")
                peers = [t[0] for n, t in tflops.items()
                         if n not in ("packed", "unpacked") and t is not None]
                ratio = (f"{min(peers) / tflops['packed'][0]:.2f}"
                         if peers and tflops.get("packed") else "—")
                print(f"| {d} | {shape} | {causal} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
