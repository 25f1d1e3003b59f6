"""Seeded GPU fuzz of bad index contents, with the content check off (GPU).

    python bench/fuzz_index.py [--cases 200] [--seed 0] [--json FILE]

On CUDA tensors a bad index content is clamped or dropped, not raised (reading it would
cost a sync), so the CPU is not the oracle here. Each case draws a `flash_attn_with_kvcache`
call (dense, paged, cache_batch_idx, cache_leftpad; appends of 0-3 rows; the kernel's append
and the torch path) or a paged `flash_attn_varlen_func` read, with one bad content of the
kinds the CPU fuzz draws (tests/fuzz_calls.py): a negative cache_seqlens, an append past the
capacity, a read past it, a block_table / page_table entry past the pages or negative, a
cache_batch_idx past the cache, a cache_leftpad past cache_seqlens, rotary tables too short,
a seqused_k past the pages. The expectation:

* no exception;
* every cache row is bitwise what this script's own model says: the rows of the append that
  fit (position in [0, capacity), its page or cache entry one of the cache) written, no
  other row changed;
* the status word (`flash_cute.check_status`) counts exactly the rows that did not fit;
* out is finite.

Run it under `compute-sanitizer --tool memcheck` (bench/index_session.sh) for "no access
outside the tensors". A miss prints its case; exit status 1 on any.
"""

import argparse
import json
import random
import sys

import torch

KINDS = ("seqlens_negative", "append_past", "read_past", "block_entry_past",
         "block_entry_negative", "batch_idx_past", "leftpad_past", "rotary_short",
         "page_entry_past", "page_entry_negative", "seqused_k_past_span")


def draw(rng: random.Random) -> dict:
    corrupt = rng.choice(KINDS)
    layout = ("paged_read" if corrupt.startswith(("page_", "seqused")) else
              "paged" if corrupt.startswith("block") else
              "batch_idx" if corrupt.startswith("batch") else
              "leftpad" if corrupt.startswith("leftpad") else rng.choice(("dense", "paged")))
    return dict(corrupt=corrupt, layout=layout, batch=rng.randint(1, 4),
                new=0 if corrupt == "read_past" else rng.choice((1, 2, 3)),
                page=rng.choice((16, 64)), slots=rng.randint(1, 4),
                sq=rng.choice((1, 1, 2, 5)), causal=rng.random() < 0.5,
                kernel=rng.random() < 0.7, seed=rng.randrange(1 << 30))


def _expected(cache, new, starts, capacity, table=None, entries=None):
    """The model: new rows at starts[b] + i where they fit, nothing else changed; with
    the count of rows that did not fit."""
    want, dropped = cache.clone(), 0
    for b in range(new.shape[0]):
        for i in range(new.shape[1]):
            pos = int(starts[b]) + i
            ok = 0 <= pos < capacity
            if ok and table is not None:
                page = int(table[b, pos // cache.shape[1]])
                ok = 0 <= page < cache.shape[0]
                if ok:
                    want[page, pos % cache.shape[1]] = new[b, i]
            elif ok:
                entry = b if entries is None else int(entries[b])
                ok = 0 <= entry < cache.shape[0]
                if ok:
                    want[entry, pos] = new[b, i]
            dropped += not ok
    return want, dropped


def run_case(case: dict) -> list:
    """The names of the expectations that failed (empty: all held)."""
    import flash_cute
    from flash_cute.api import kvcache

    gen = torch.Generator(device="cuda").manual_seed(case["seed"])
    kvcache.APPEND_IN_KERNEL = case["kernel"]
    b, new, sq, page = case["batch"], case["new"], case["sq"], case["page"]
    hk, h, d = 2, 8, 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    paged = case["layout"] in ("paged", "paged_read")
    table = entries = leftpad = cos = sin = None
    if paged:
        pages = b * case["slots"] + 2
        kc, vc = randn(pages, page, hk, d), randn(pages, page, hk, d)
        table = torch.randperm(pages, generator=gen, device="cuda")[:b * case["slots"]]
        table = table.view(b, case["slots"]).int()
        capacity = case["slots"] * page
    else:
        capacity = case["slots"] * page
        # A spare entry only where cache_batch_idx picks the entries: a dense cache has one
        # per sequence.
        entries_n = b + 1 if case["layout"] == "batch_idx" else b
        kc, vc = randn(entries_n, capacity, hk, d), randn(entries_n, capacity, hk, d)
        if case["layout"] == "batch_idx":
            entries = torch.randperm(b + 1, generator=gen, device="cuda")[:b].int()
    seqlens = torch.randint(0, max(capacity - new, 0) + 1, (b,), generator=gen,
                            device="cuda", dtype=torch.int32)
    q, k, v = randn(b, sq, h, d), randn(b, new, hk, d), randn(b, new, hk, d)
    corrupt, row = case["corrupt"], int(torch.randint(0, b, (1,), generator=gen, device="cuda"))
    if corrupt == "seqlens_negative":
        seqlens[row] = -int(torch.randint(1, 5, (1,), generator=gen, device="cuda"))
    elif corrupt in ("append_past", "read_past", "seqused_k_past_span"):
        seqlens[row] = capacity - new + int(torch.randint(1, 9, (1,), generator=gen,
                                                          device="cuda"))
    elif corrupt.startswith(("block_entry", "page_entry")):
        slot = min(max(int(seqlens[row]) + new - 1, 0) // page, case["slots"] - 1)
        table[row, slot] = table.numel() + 7 if corrupt.endswith("past") else -3
    elif corrupt == "batch_idx_past":
        entries[row] = b + 1 + row
    elif corrupt == "leftpad_past":
        leftpad = seqlens.clone()
        leftpad[row] += 3
    elif corrupt == "rotary_short":
        half = d // 4
        angles = torch.rand(max(int(seqlens.max()), 1), half, generator=gen, device="cuda")
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    before_k, before_v = kc.cpu(), vc.cpu()
    flash_cute.check_status("cuda", raise_error=False)
    if case["layout"] == "paged_read":
        out, _ = flash_cute.flash_attn_varlen_func(q, kc, vc, page_table=table,
                                                   seqused_k=seqlens, causal=case["causal"])
        torch.cuda.synchronize()
        fails = [] if torch.isfinite(out.float()).all() else ["out not finite"]
        if not (torch.equal(kc.cpu(), before_k) and torch.equal(vc.cpu(), before_v)):
            fails.append("a read changed the cache")
        return fails
    out = flash_cute.flash_attn_with_kvcache(
        q, kc, vc, k if new else None, v if new else None, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=seqlens, cache_batch_idx=entries, cache_leftpad=leftpad,
        block_table=table, causal=case["causal"])
    torch.cuda.synchronize()
    fails = [] if torch.isfinite(out.float()).all() else ["out not finite"]
    if cos is not None and new:
        return fails   # rotated rows: the cache model would have to rotate with clamping
    host = dict(table=None if table is None else table.cpu(),
                entries=None if entries is None else entries.cpu())
    want_k, dropped = _expected(before_k, k.cpu(), seqlens.cpu(), capacity, **host)
    want_v, _ = _expected(before_v, v.cpu(), seqlens.cpu(), capacity, **host)
    if not (torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)):
        fails.append("cache differs from the model")
    counted = flash_cute.check_status("cuda", raise_error=False)
    if counted != dropped:
        fails.append(f"status word {counted}, model {dropped}")
    return fails


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    misses, counts = [], {}
    for i in range(args.cases):
        case = draw(rng)
        counts[case["corrupt"]] = counts.get(case["corrupt"], 0) + 1
        try:
            fails = run_case(case)
        except Exception as exc:  # noqa: BLE001 - every exception is a finding
            fails = [repr(exc)]
            if "CUDA" in str(exc) or "illegal" in str(exc):
                misses.append((i, case, fails))
                print(f"[{i}] CUDA ERROR, stopping: {exc!r}\n  {case}", flush=True)
                break
        if fails:
            misses.append((i, case, fails))
            print(f"[{i}] MISS {fails}\n  {case}", flush=True)
    print(f"fuzz_index --seed {args.seed}: {args.cases} cases, {len(misses)} misses; "
          + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(misses=misses, counts=counts, seed=args.seed), f, indent=1,
                      default=str)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
