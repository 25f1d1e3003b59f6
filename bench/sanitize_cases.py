"""One small case of every kernel family and variant, forward and backward, for
`bench/sanitize.sh` (run under compute-sanitizer) — GPU.

    python bench/sanitize_cases.py [--arch hopper|ampere]

Families: the attention forward and backward (with the backward's preprocess and dQ
postprocess), padded and varlen (an empty sequence, lengths that end mid-tile), GQA and
packed GQA, causal, a sliding window, softcap, seqused, the deterministic backward, and the
shared blocks' kernels (score attention, LSE merge), and decode (split-KV, paged K/V with
garbage page indices). Index contents past the tensors are
included: the clamps of `flash_cute.blocks.seqlen` must keep every access inside. Prints one line
per case; exits 1 if a result is not finite.
"""

import argparse
import sys

import torch


def cases(arch: str):
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    base = dict(arch=arch)
    yield "padded", dict(shape=(2, 77, 4, 2, 64), kw=dict(base))
    yield "causal d128", dict(shape=(1, 130, 4, 4, 128), kw=dict(base, causal=True))
    yield "window softcap", dict(shape=(1, 150, 2, 2, 64),
                                 kw=dict(base, window_size=(33, 7), softcap=20.0))
    yield "gqa d256", dict(shape=(1, 65, 8, 2, 256), kw=dict(base, causal=True))
    yield "d192/128", dict(shape=(1, 70, 2, 1, 192), kw=dict(base), dv=128)
    if arch == "hopper":
        yield "packed gqa", dict(shape=(1, 5, 16, 2, 128), kw=dict(base, pack_gqa=True))
        yield "deterministic", dict(shape=(1, 200, 2, 2, 64), kw=dict(base, deterministic=True))
    yield "varlen empty seq", dict(varlen=(cu(0, 50, 50, 177), 127), kw=dict(base, causal=True))
    yield "varlen past the tensor", dict(varlen=(cu(0, 64, 4096), 4096), kw=dict(base),
                                         total=200)
    yield "seqused", dict(shape=(2, 96, 2, 2, 64),
                          kw=dict(base, seqused_q=cu(96, 5), seqused_k=cu(500, 0)))


def run_case(spec: dict) -> torch.Tensor:
    from flash_cute import flash_attn_func, flash_attn_varlen_func

    kw = dict(spec["kw"])
    if "varlen" in spec:
        cu, max_len = spec["varlen"]
        total = spec.get("total", int(cu[-1]))
        q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=max_len, max_seqlen_k=max_len, **kw)
    else:
        b, s, h, hk, d = spec["shape"]
        dv = spec.get("dv", d)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, s, hk, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        used = {n: kw.pop(n) for n in ("seqused_q", "seqused_k") if n in kw}
        if used:
            out, _ = flash_attn_varlen_func(q, k, v, **used, **kw)
        else:
            out, _ = flash_attn_func(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return torch.stack([t.float().abs().sum() for t in (out, *grads)])


def blocks() -> torch.Tensor:
    from flash_cute.runtime.lse_merge import lse_merge
    from flash_cute.tools.block_kernels import score_attention

    scores = torch.randn(2, 97, 131, device="cuda")
    v = torch.randn(2, 131, 16, device="cuda", dtype=torch.bfloat16)
    out, _ = score_attention(scores, v, 0.3, True, (None, None), 0.0)
    merged, _ = lse_merge(torch.randn(3, 77, 64, device="cuda"), torch.randn(3, 77, device="cuda"))
    return torch.stack([out.float().abs().sum(), merged.float().abs().sum()])


def decode() -> torch.Tensor:
    """Split-KV and paged decode, forward only: garbage page indices (negative, past the
    cache, INT32_MAX) and cache lengths past the cache, which the kernels clamp; the
    in-kernel append with garbage cache lengths."""
    from flash_cute import flash_attn_varlen_func, flash_attn_with_kvcache

    q = torch.randn(3, 4, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(40, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randint(0, 40, (3, 12), dtype=torch.int32, device="cuda")
    table[0, 1], table[1, 5], table[2, 11] = -7, 40, 2 ** 31 - 1
    used = torch.tensor([0, 700, 5000], dtype=torch.int32, device="cuda")
    sums = []
    for splits in (1, 0, 7):
        out, lse = flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used,
                                          causal=True, num_splits=splits, return_lse=True)
        sums.append(out.float().abs().sum())
    dense_k = torch.randn(3, 3000, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = flash_attn_varlen_func(q, dense_k, dense_k, seqused_k=used, num_splits=5)
    sums.append(out.float().abs().sum())
    # The in-kernel append (`kv_append`) with lengths before, inside and past the caches.
    new = torch.randn(3, 4, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([-9, 700, 2 ** 31 - 5], dtype=torch.int32, device="cuda")
    for cache, pages in ((k, table), (dense_k, None)):
        out = flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=lens,
                                      block_table=pages, causal=True)
        sums.append(out[1:].float().abs().sum())
    return torch.stack(sums)


def _zero_tma_outputs() -> None:
    """Fill O, dK and dV with zeros (a torch kernel: initcheck sees that) as they are
    allocated; every other buffer keeps its real allocation, so initcheck still checks it."""
    from flash_cute.runtime import launch_bwd, launch_fwd

    fwd_alloc, dkv_alloc = launch_fwd.ForwardLaunch._alloc, launch_bwd.BackwardLaunch._alloc_dkv

    def forward_outputs(self):
        out, lse = fwd_alloc(self)
        return out.zero_(), lse

    def dkv_outputs(self):
        return tuple(t.zero_() for t in dkv_alloc(self))

    launch_fwd.ForwardLaunch._alloc = forward_outputs
    launch_bwd.BackwardLaunch._alloc_dkv = dkv_outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="hopper", choices=("hopper", "ampere"))
    p.add_argument("--zero-tma-outputs", action="store_true",
                   help="zero the outputs the hopper kernels store by TMA (O, dK, dV) before "
                        "the kernels run: initcheck counts no TMA store as a write")
    p.add_argument("--decode-only", action="store_true",
                   help="only the decode family (split-KV, paged, the in-kernel append)")
    args = p.parse_args()
    if args.zero_tma_outputs:
        _zero_tma_outputs()
    torch.manual_seed(0)
    bad = 0
    for name, spec in [] if args.decode_only else cases(args.arch):
        print(f"== {args.arch} {name}", flush=True)
        sums = run_case(spec)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(sums).all())
        bad += not ok
        print(f"{args.arch} {name}: {'ok' if ok else 'NOT FINITE'}", flush=True)
    if args.arch == "hopper":
        ok = bool(torch.isfinite(decode()).all())
        bad += not ok
        print(f"decode (split-KV, paged, garbage indices): {'ok' if ok else 'NOT FINITE'}",
              flush=True)
    if args.decode_only:
        return int(bad > 0)
    ok = bool(torch.isfinite(blocks()).all())
    bad += not ok
    print(f"blocks (score attention, lse merge): {'ok' if ok else 'NOT FINITE'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
