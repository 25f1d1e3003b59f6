"""Attention variants on the GPU: flash-cute's traced mods against torch's FlexAttention
(torch.compile'd, its block mask skipping empty blocks) on the very same functions, forward
and backward, in one run with rounds interleaved; the built-in causal and window beside them,
and FA4's own score_mod / mask_mod path (`flash_attn.cute`, sm90) on each case's FA4-form twin
where FA4 is installed.

    python bench/variants.py [--seqlen 8192] [--hdim 128] [--rounds 3] [--cases alibi,...]
                             [--fwd-ablation]
    python bench/variants.py --sweep [--cases ...]

`--sweep`: each case over 20 lengths from 1k to 16k (odd ones), forward and backward once
each, counting the kernels compiled at the first length and after it (the compile key holds
the mods' graph, never a length: after the first length it must stay 0).

Times are medians in ms (triton's do_bench, L2 flushed); `vs flex` is FlexAttention's time
over the provider's. A case with a mask mod runs flash-cute with the very block mask
FlexAttention gets (`create_block_mask`; block sparsity: empty tiles skipped, full ones
without the mask rule), causal=False: the mask is the mod's alone. `--fwd-ablation` adds the
hopper forward with intra-warpgroup overlap off (its registers with a mod's loads,
D-MODS-KERNEL).
"""

import argparse
import dataclasses

import torch

from flash_cute import flash_attn_func
from flash_cute.tools.bench.measure import interleaved_times, make_timer
from flash_cute.tools.bench.report import markdown_table
from flash_cute.variants import examples as mod_examples
from flash_cute.variants import registry


def _cases(batch, seqlen, nheads):
    """name -> case: flash-cute's mods, FlexAttention's mask where it differs, and `fa4`, the
    FA4-form twin (`flash_cute.blocks.fa4_mod_examples`) FA4's own path runs."""
    from flash_cute.blocks import fa4_mod_examples as fa4

    slopes = torch.exp2(-8.0 * torch.arange(1, nheads + 1, device="cuda") / nheads)
    docs = torch.arange(seqlen, device="cuda") * 7 // seqlen          # 7 equal documents
    doc_ids = docs.to(torch.int32).expand(batch, seqlen).contiguous()
    causal = lambda b, h, q, k: k <= q  # noqa: E731
    return {
        "causal (mask_mod)": dict(mask_mod=causal, fa4=dict(mask_mod=fa4.causal)),
        "alibi + causal": dict(score_mod=mod_examples.alibi(slopes), causal=True,
                               flex_mask=causal,
                               fa4=dict(score_mod=fa4.alibi, score_mod_bwd=fa4.bias_bwd,
                                        aux_tensors=[slopes.float()], causal=True)),
        "document": dict(mask_mod=mod_examples.document_mask(doc_ids),
                         fa4=dict(mask_mod=fa4.document_causal, aux_tensors=[doc_ids])),
        "sliding window 1024": dict(mask_mod=mod_examples.sliding_window(1024),
                                    fa4=dict(mask_mod=fa4.sliding_window(1024))),
        "softcap 30 (score_mod)": dict(score_mod=mod_examples.softcap(30.0),
                                       fa4=dict(softcap=30.0)),
    }


def _block_mask(q, k, case):
    from flash_cute import create_block_mask

    mask = case.get("flex_mask", case.get("mask_mod"))
    return None if mask is None else create_block_mask(mask, q.shape[0], q.shape[2],
                                                       q.shape[1], k.shape[1], device="cuda")


def _ours(q, k, v, case, schedule=None):
    """flash-cute's forward for `case` (a hopper `schedule` override: planned directly)."""
    score_mod = case.get("score_mod")
    block_mask = None if case.get("causal") else _block_mask(q, k, case)
    if schedule is None:
        return lambda: flash_attn_func(q, k, v, causal=case.get("causal", False),
                                       score_mod=score_mod, block_mask=block_mask)[0]
    from flash_cute.arch.hopper import planner as api
    from flash_cute.runtime.problem import validate_attention_inputs

    key = registry.register(score_mod, None, block_mask)
    problem = dataclasses.replace(validate_attention_inputs(q, k, v,
                                                            causal=case.get("causal", False)),
                                  mods=registry.lookup(key), mods_key=key)
    launch = api.plan_forward(q, k, v, problem, schedule=schedule)
    return lambda: launch(q, k, v)[0]


def _fa4(q, k, v, case):
    """FA4's score_mod / mask_mod path (`flash_attn.cute.flash_attn_func`) on the case's
    FA4-form twin, FlexAttention's block mask as its block-sparsity tensors (forward and
    backward); None where FA4 is not installed."""
    try:
        from flash_attn.cute import flash_attn_func as fa4_attn
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except ImportError:
        return None
    kw = dict(case["fa4"])
    block_mask = None if case.get("causal") else _block_mask(q, k, case)
    if block_mask is not None:
        size = tuple(block_mask.BLOCK_SIZE)
        kw["block_sparse_tensors"] = BlockSparseTensorsTorch(
            block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, block_size=size)
        kw["block_sparse_tensors_bwd"] = BlockSparseTensorsTorch(
            block_mask.q_num_blocks, block_mask.q_indices, block_mask.full_q_num_blocks,
            block_mask.full_q_indices, block_size=size)
    fn = lambda: fa4_attn(q, k, v, **kw)[0]  # noqa: E731
    try:   # FA4 refuses some combinations on sm90: left out of the table, with its reason
        out = fn()
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    except Exception as exc:  # noqa: BLE001 - any refusal of FA4's
        print(f"FA4 left out: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
    return fn


def _flex(q, k, v, case, flex):
    block_mask = _block_mask(q, k, case)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: flex(qt, kt, vt, score_mod=case.get("score_mod"),
                        block_mask=block_mask).transpose(1, 2)


def _disagreeing(name, fns, tol=0.1):
    """The providers whose forward output differs from flash-cute's by more than `tol`, well
    above bf16's rounding of O (a twin that is not the same attention moves whole rows), each
    named on stdout and marked in the table."""
    with torch.no_grad():
        ours = fns["flash-cute"]().float()
        wrong = set()
        for provider, fn in fns.items():
            err = (fn().float() - ours).abs().max().item()
            if err > tol:
                print(f"{name}: {provider} differs from flash-cute by {err:.3f}", flush=True)
                wrong.add(provider)
    return wrong


def _backward(fwd, inputs):
    out = fwd()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _sweep(cases_at, names, hdim):
    """Per case: the kernels compiled at the first length and at the 19 others."""
    from flash_cute.runtime.jit import compile_cache

    lengths = [int(n) | 1 for n in torch.linspace(1024, 16384, 20).tolist()]
    rows = []
    for name in names:
        counts = []
        for i, seqlen in enumerate(lengths):
            before = len(compile_cache._entries)
            q, k, v = (torch.randn(1, seqlen, 2048 // hdim, hdim, device="cuda",
                                   dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            case = cases_at(seqlen)[name]
            out = _ours(q, k, v, case)()
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            torch.cuda.synchronize()
            counts.append(len(compile_cache._entries) - before)
        rows.append([name, str(len(lengths)), str(counts[0]), str(sum(counts[1:]))])
        print(rows[-1], flush=True)
    print(f"\nlengths {lengths[0]}..{lengths[-1]} (20), hdim {hdim}, bf16\n")
    print(markdown_table(["case", "lengths", "compiled at the first", "compiled after"], rows))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--fwd-ablation", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-fa4", dest="fa4", action="store_false",
                   help="leave out FA4's score_mod / mask_mod path")
    args = p.parse_args()
    if args.sweep:
        nheads = 2048 // args.hdim
        names = [n for n in _cases(1, 1024, nheads)
                 if not args.cases or n.split(" ")[0] in args.cases.split(",")]
        return _sweep(lambda seqlen: _cases(1, seqlen, nheads), names, args.hdim)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    batch, nheads = max(1, 16384 // args.seqlen), 2048 // args.hdim
    q, k, v = (torch.randn(batch, args.seqlen, nheads, args.hdim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cases = _cases(batch, args.seqlen, nheads)
    if args.cases:
        cases = {n: c for n, c in cases.items() if n.split(" ")[0] in args.cases.split(",")}
    timer = make_timer(10, 50)
    rows = []
    for name, case in cases.items():
        fns = {"flash-cute": _ours(q, k, v, case), "flex": _flex(q, k, v, case, flex)}
        fa4 = _fa4(q, k, v, case) if args.fa4 else None
        if fa4 is not None:
            fns["FA4"] = fa4
        if name.startswith("causal"):
            fns["flash-cute built-in causal"] = _ours(q, k, v, {"causal": True})
        if "sliding" in name:
            fns["flash-cute built-in window"] = lambda: flash_attn_func(
                q, k, v, causal=True, window_size=(1023, 0))[0]
        if args.fwd_ablation:
            from flash_cute.arch.hopper.config import fwd_schedule

            fns["flash-cute, no intra-wg overlap"] = _ours(
                q, k, v, case, fwd_schedule(args.hdim)._replace(intra_wg_overlap=False))
        wrong = _disagreeing(name, fns)
        for direction in ("fwd", "bwd"):
            timed = fns if direction == "fwd" else {
                n: _backward(f, (q, k, v)) for n, f in fns.items() if "overlap" not in n}
            stats = interleaved_times(timed, args.rounds, timer)
            base = stats["flex"][0]
            for provider, st in stats.items():
                label = f"{provider} (WRONG)" if provider in wrong else provider
                rows.append([name, direction, label, f"{st[0]:.3f}", f"{base / st[0]:.2f}"])
                print(rows[-1], flush=True)
    print(f"\nbf16, hdim {args.hdim}, {batch} x {args.seqlen} tokens, {nheads} heads\n")
    print(markdown_table(["case", "pass", "provider", "ms", "vs flex"], rows))


if __name__ == "__main__":
    main()
