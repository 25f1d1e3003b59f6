"""`python -m flash_cute bench decode`: decode attention in GB/s, next to cuDNN, FA2 and FA4.

At decode a few query rows attend to a long KV cache, so the time is that of reading K and V
once from HBM. GB/s counts the K and V bytes of the cache (b x L x heads_kv x d x 2 tensors x
2 bytes) over the median time of triton's `do_bench`, which flushes the L2 between runs (a
1 x 8k cache is 34 MB and would stay in the H200's 60 MB L2). Next to the providers, the same
run measures the HBM read rate of a pure read (a sum over a 2 GB tensor): the ceiling.

Cells: b x L over `GRID`, GQA 32:8, d 128, bf16, 1 and 4 query tokens; the cache dense, or
paged at pages of 16, 64 and 256 rows (a random page order). Providers, interleaved per cell:

* flash_cute: `flash_attn_with_kvcache` (num_splits 0, the heuristic), dense or block_table;
* cudnn, fa2: torch SDPA's cuDNN and flash (FlashAttention-2) backends, enable_gqa, dense;
* fa4: flash_attn.cute's `flash_attn_varlen_func` with seqused_k (dense) or page_table.

Query tokens attend to every cached key (no mask): with 1 or 4 rows a causal mask changes
no byte read, and SDPA's causal mask is aligned top-left, another problem.
"""

import json
import os
import sys
import time

GRID = ((1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192), (128, 2048))
PAGES = (None, 16, 64, 256)
QUERIES = (1, 4)
HEADS, HEADS_KV, HDIM = 32, 8, 128
PROVIDERS = ("flash_cute", "cudnn", "fa2", "fa4")
READ_BYTES = 2 << 30


def cache_bytes(batch: int, seqlen: int, heads_kv: int = HEADS_KV, hdim: int = HDIM) -> int:
    """Bytes of K and V (bf16) in a cache of `seqlen` rows per sequence."""
    return batch * seqlen * heads_kv * hdim * 2 * 2


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _paged(k, v, page):
    """k / v [b, L, hk, d] as a paged cache [pages, page, hk, d] in a random page order, and
    its block table int32 [b, L / page]."""
    import torch

    b, seqlen = k.shape[:2]
    n = b * seqlen // page
    order = torch.randperm(n, device=k.device)
    table = order.view(b, seqlen // page).to(torch.int32)
    k_pages = torch.empty(n, page, *k.shape[2:], dtype=k.dtype, device=k.device)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k.reshape(n, page, *k.shape[2:])
    v_pages[order] = v.reshape(n, page, *v.shape[2:])
    return k_pages, v_pages, table


def _calls(q, k, v, page):
    """{provider: a no-argument call} for one cell (providers that cannot run it left out,
    with the reason in the second dict)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_cute.api.kvcache import flash_attn_with_kvcache

    b, seqlen = k.shape[:2]
    lengths = torch.full((b,), seqlen, dtype=torch.int32, device=q.device)
    calls, skipped = {}, {}
    if page is None:
        calls["flash_cute"] = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("fa2", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            calls[name] = sdpa
    else:
        k_pages, v_pages, table = _paged(k, v, page)
        calls["flash_cute"] = lambda: flash_attn_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=lengths, block_table=table)
        skipped["cudnn"] = skipped["fa2"] = "no paged KV in SDPA"
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception as exc:
        skipped["fa4"] = f"flash_attn.cute not importable: {exc}"
    else:
        if page is None:
            calls["fa4"] = lambda: fa4(q, k, v, seqused_k=lengths)
        else:
            calls["fa4"] = lambda: fa4(q, k_pages, v_pages, seqused_k=lengths, page_table=table)
    return calls, skipped


def cold_graph_ms(fn, flush: str = "write", reps: int = 50) -> float:
    """GPU time of `fn` with the L2 flushed before each call and no host: a CUDA graph of
    (flush, fn) less one of the flush alone, each replayed `reps` times, medians. `flush`:
    "write" zeroes 256 MB as triton's `do_bench` does, which leaves the L2 full of dirty lines
    that `fn`'s reads then write back; "read" sums 256 MB, which leaves it clean."""
    import torch

    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flush_fn = cache.zero_ if flush == "write" else (lambda: cache.sum(dtype=torch.int32))

    def timed(body):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        times = []
        for _ in range(reps):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[reps // 2]

    return timed(lambda: (flush_fn(), fn())) - timed(flush_fn)


def hbm_read_rate(timer) -> float:
    """GB/s of a sum over a `READ_BYTES` bf16 tensor (what a pure read reaches)."""
    import torch

    x = torch.ones(READ_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    ms = timer(x.sum)
    x = None
    torch.cuda.empty_cache()
    return gbps(READ_BYTES, ms)


def run_cell(batch, seqlen, queries, page, timer, rounds: int = 3) -> list:
    """Records of one cell: each provider's median over `rounds` interleaved timings."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(batch * seqlen + queries)
    shape = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, queries, HEADS, HDIM, **shape)
    k = torch.randn(batch, seqlen, HEADS_KV, HDIM, **shape)
    v = torch.randn(batch, seqlen, HEADS_KV, HDIM, **shape)
    calls, skipped = _calls(q, k, v, page)
    cell = dict(batch=batch, seqlen=seqlen, queries=queries, page=page)
    records = [dict(cell, provider=p, status="skipped", reason=r) for p, r in skipped.items()]
    times = {name: [] for name in calls}
    errors = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            if name in errors:
                continue
            try:
                times[name].append(timer(fn))
            except Exception as exc:   # a provider's refusal is a record, not a crash
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    for name, ts in times.items():
        if name in errors:
            records.append(dict(cell, provider=name, status="error", reason=errors[name]))
            continue
        ms = sorted(ts)[len(ts) // 2]
        records.append(dict(cell, provider=name, status="ok", ms=ms,
                            gbps=gbps(cache_bytes(batch, seqlen), ms)))
    del q, k, v, calls
    torch.cuda.empty_cache()
    return records


def format_table(records: list, read_rate: float) -> str:
    """Markdown: one row per cell, GB/s per provider, and flash_cute / best peer."""
    cells = {}
    for r in records:
        key = (r["batch"], r["seqlen"], r["queries"], r["page"] or 0)
        cells.setdefault(key, {})[r["provider"]] = r
    head = ["b x L", "q", "page"] + list(PROVIDERS) + ["ours/best", "of HBM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (b, seqlen, queries, page), row in sorted(cells.items()):
        vals = {p: row[p]["gbps"] for p in PROVIDERS if row.get(p, {}).get("status") == "ok"}
        cols = [f"{vals[p]:,.0f}" if p in vals else "-" for p in PROVIDERS]
        peers = [vals[p] for p in PROVIDERS[1:] if p in vals]
        ours = vals.get("flash_cute")
        ratio = f"{ours / max(peers):.2f}" if ours and peers else "-"
        of_hbm = f"{ours / read_rate:.2f}" if ours else "-"
        lines.append(f"| {b} x {seqlen // 1024}k | {queries} | {page or 'dense'} | "
                     + " | ".join(cols) + f" | {ratio} | {of_hbm} |")
    lines.append(f"\nHBM read rate in this run (sum over {READ_BYTES >> 30} GB): "
                 f"{read_rate:,.0f} GB/s")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash_cute.tools.bench.measure import make_timer
    from flash_cute.tools.bench.report import environment_info

    timer = make_timer(args.warmup, args.rep)
    read_rate = hbm_read_rate(timer)
    records = []
    pages = PAGES if args.pages is None else tuple(None if p == 0 else p for p in args.pages)
    for batch, seqlen in GRID:
        for page in pages:
            for queries in QUERIES:
                recs = run_cell(batch, seqlen, queries, page, timer)
                records += recs
                print(f"{batch}x{seqlen} q{queries} page {page or 'dense'}: " + ", ".join(
                    f"{r['provider']} {r['gbps']:,.0f}" if r["status"] == "ok"
                    else f"{r['provider']} {r['status']}" for r in recs), file=sys.stderr,
                    flush=True)
    table = format_table(records, read_rate)
    print(table)
    out = args.out or os.path.join("results", f"decode-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump({"env": environment_info(), "hbm_read_gbps": read_rate,
                   "records": records}, f, indent=1)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(table + "\n")
    return 0
