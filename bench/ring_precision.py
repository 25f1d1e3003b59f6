"""The ring's partials in 16 bits against float32, one process, no GPU
(`flash_cute.parallel.precision.simulate_ring`): for each ring size, the error of the whole
sequence's output against float64 and whether it meets the FlashAttention rule (≤ 2x a bf16
PyTorch implementation's error + 2 ulp).

    python bench/ring_precision.py [--seqlen 2304] [--v-mean 1.0] [--worlds 2,3,4,6,8,12,16,24,32]

--v-mean shifts V (O's magnitude follows it: real activations are not centred on 0)."""

import argparse

import torch

from flash_cute.parallel.precision import simulate_ring
from flash_cute.reference.attention import attention_ref, tolerance_check


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=2304)
    ap.add_argument("--v-mean", type=float, default=1.0)
    ap.add_argument("--worlds", default="2,3,4,6,8,12,16,24,32")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.seqlen, 1, 64, generator=g) for _ in range(3))
    q, k, v = q.bfloat16(), k.bfloat16(), (v + args.v_mean).bfloat16()
    ref = attention_ref(q, k, v, causal=args.causal, mode="float64")[0]
    native = attention_ref(q, k, v, causal=args.causal, mode="native")[0]
    print(f"seqlen {args.seqlen}, V mean {args.v_mean}, causal {args.causal}; "
          f"the rule: err <= 2 x native + atol")
    print("| w | bf16 partials: err | rule | fp32 partials: err | rule | native err | atol |")
    print("|---:|---:|---|---:|---|---:|---:|")
    for w in (int(x) for x in args.worlds.split(",")):
        r16, r32 = (tolerance_check(simulate_ring(q, k, v, w, dt, args.causal).bfloat16(),
                                    ref, native) for dt in (torch.bfloat16, torch.float32))
        print(f"| {w} | {r16.err:.2e} | {'pass' if r16.ok else 'FAIL'} | {r32.err:.2e} | "
              f"{'pass' if r32.ok else 'FAIL'} | {r16.err_native:.2e} | {r16.atol:.2e} |")


if __name__ == "__main__":
    main()
