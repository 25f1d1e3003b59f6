"""The set of compile keys a grid of calls asks for, recorded without compiling: a check that a
structural change (a move of modules, a split) leaves every kernel configuration as it was.

    python bench/compile_keys.py --out keys.json                # this tree
    (cd OLD_TREE && python /path/to/bench/compile_keys.py --out old.json)
    python bench/compile_keys.py --compare old.json keys.json

A recorder takes the compile cache's place: each `KernelCall` hands it its key and gets a stub
back, and `compile_only` launches nothing, so the grid (every dtype, head dim, mask, layout,
split, paged, mods, dropout; forward and backward) runs on meta tensors in seconds, one process
per SM target (CuTe DSL fixes its target at import), as `cache warm` drives the pipelines.
A call a pipeline refuses is recorded with its error. The mods are defined here, so that their
identity (an FA4-form mod's hash covers its module and source) does not depend on the tree.
Runs on the tree it is started in (the current directory first on the path) and on the tree
before the layered move, whose module paths it falls back to.
"""

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys

TARGETS = {"sm_80": "ampere", "sm_90a": "hopper", "sm_100a": "blackwell"}
HDIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
MASKS = {"none": dict(), "causal": dict(causal=True), "local": dict(window_size=(64, 32))}
EXTRAS = ("plain", "softcap", "gqa", "dropout", "score_mod", "mask_mod", "fa4_mod", "split",
          "paged")


def _modules():
    try:
        from flash_cute.runtime import dispatch, jit
        from flash_cute.runtime.problem import validate_attention_inputs
        try:
            from flash_cute.variants import registry as mod_graph
        except ImportError:  # the tree before mod_graph's split
            from flash_cute.variants import mod_graph
    except ImportError:  # the tree before the layered move
        from flash_cute import dispatch, jit, mod_graph
        from flash_cute.validation import validate_attention_inputs
    return dispatch, jit, validate_attention_inputs, mod_graph


def _score_mod(score, b, h, q_idx, kv_idx):
    return score + 0.125 * (q_idx - kv_idx)


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) < 200


def _fa4_score_mod():
    import cutlass.cute as cute

    @cute.jit
    def fa4_bias(score, b, h, q_idx, kv_idx, seqlen_info, aux):
        return score + cute.full_like(score, 0.5)

    return fa4_bias


def _register(mod_graph, extra):
    if extra == "score_mod":
        return mod_graph.register(_score_mod, None)
    if extra == "mask_mod":
        return mod_graph.register(None, _mask_mod)
    return mod_graph.register_fa4(_fa4_score_mod(), None, None, (), ())


def _call(pipeline, jit, validate, mod_graph, dtype, hdims, mask, varlen, extra):
    import torch

    hdim, hdim_v = hdims
    heads_kv, group = 2, (4 if extra == "gqa" else 1)
    seqlen_q = 1 if extra in ("split", "paged") else 1000
    seqlen_k, batch = 3000, 2
    lead_q = (batch * seqlen_q,) if varlen else (batch, seqlen_q)
    lead_k = (batch * seqlen_k,) if varlen else (batch, seqlen_k)
    q = torch.empty(*lead_q, heads_kv * group, hdim, dtype=dtype, device="meta")
    k = torch.empty(*lead_k, heads_kv, hdim, dtype=dtype, device="meta")
    v = torch.empty(*lead_k, heads_kv, hdim_v, dtype=dtype, device="meta")
    kw, cu_q, cu_k = {}, None, None
    if varlen:
        cu_q = torch.tensor([0, seqlen_q, 2 * seqlen_q], dtype=torch.int32)
        cu_k = torch.tensor([0, seqlen_k, 2 * seqlen_k], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q,
                  max_seqlen_k=seqlen_k)
    kw.update(MASKS[mask])
    if extra == "softcap":
        kw["softcap"] = 15.0
    if extra == "dropout":
        kw["dropout_p"] = 0.1
    if extra == "split":
        kw["num_splits"] = 3
    problem = validate(q, k, v, require_cuda=False, **kw)
    if extra in ("score_mod", "mask_mod", "fa4_mod"):
        key = _register(mod_graph, extra)
        problem = dataclasses.replace(problem, mods=mod_graph.lookup(key), mods_key=key)
    page_table = None
    if extra == "paged":
        page = 16
        pages = -(-seqlen_k // page)
        k = torch.empty(batch * pages, page, heads_kv, hdim, dtype=dtype, device="meta")
        v = torch.empty(batch * pages, page, heads_kv, hdim_v, dtype=dtype, device="meta")
        page_table = torch.empty(batch, pages, dtype=torch.int32, device="meta")
    seed = torch.empty(1, dtype=torch.int64, device="meta") if extra == "dropout" else None
    paged = {"page_table": page_table} if page_table is not None else {}
    with jit.compile_only():
        out, lse = _stage("fwd", lambda: pipeline.plan_forward(
            q, k, v, problem, cu_q, cu_k, None, None, **paged)(
            q, k, v, cu_q, cu_k, None, None, rng_seed=seed))
        if pipeline.plan_backward is None or extra in ("split", "paged") or out is None:
            return
        for deterministic in (False, True):
            _stage(f"bwd deterministic={deterministic}", lambda: pipeline.plan_backward(
                out, None, q, k, v, out, lse, problem, cu_q, cu_k, None, None,
                deterministic)(out, None, q, k, v, out, lse, cu_q, cu_k, None, None,
                               rng_seed=seed))


_REFUSED = []


def _stage(name, run):
    """`run()`, or (None, None) with its refusal recorded (a stage a pipeline refuses)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a refusal is part of what is compared
        text = str(exc).splitlines()[0] if str(exc) else ""
        _REFUSED.append(f"{name}: {type(exc).__name__}: {text}")
        return None, None


def record(target: str) -> dict:
    """{call: its sorted compile keys and the refusals of its stages} over the grid, in this
    process."""
    import torch

    dispatch, jit, validate, mod_graph = _modules()
    pipeline = dispatch.pipeline_named(TARGETS[target])
    # No CUDA here: a split's scratch asks whether a graph is being captured.
    torch.cuda.is_current_stream_capturing = lambda: False
    asked = []
    jit.compile_cache.get = lambda key, build, options="": (asked.append(f"{key!r} {options}"),
                                                            lambda *a: None)[1]
    out = {}
    for dtype, hdims, mask, varlen, extra in itertools.product(
            (torch.bfloat16, torch.float16), HDIMS, MASKS, (False, True), EXTRAS):
        name = f"{target} {dtype} {hdims} {mask} varlen={varlen} {extra}"
        asked.clear()
        _REFUSED.clear()
        _stage("validate", lambda: _call(pipeline, jit, validate, mod_graph, dtype, hdims, mask,
                                         varlen, extra))
        out[name] = sorted(set(asked)) + sorted(set(_REFUSED))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where the recorded keys go (JSON)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a worker: one target, JSON on stdout
    args = ap.parse_args(argv)
    if args.one:
        # The tree in the current directory first (a script's own folder leads sys.path).
        sys.path.insert(0, os.getcwd())
        import flash_cute.arch

        where = os.path.realpath(flash_cute.arch.__path__[0])
        if not where.startswith(os.path.realpath(os.getcwd()) + os.sep):
            raise SystemExit(f"flash_cute.arch comes from {where}: run in a tree that holds "
                             "flash_cute/ with arch/ inside")
        print(json.dumps(record(args.one)))
        return 0
    if args.compare:
        old, new = (json.load(open(p)) for p in args.compare)
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        keys = sum(len([x for x in v if x.startswith("CompileKey")]) for v in new.values())
        errors = sum(len([x for x in v if not x.startswith("CompileKey")]) for v in new.values())
        print(f"{len(new)} calls, {keys} keys, {errors} refusals; {len(differ)} differ")
        for k in differ[:20]:
            print(f"  {k}:\n    old {old.get(k)}\n    new {new.get(k)}")
        return 1 if differ else 0
    result = {}
    for target in args.targets.split(","):
        env = {**os.environ, "CUTE_DSL_ARCH": target}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", target],
                              env=env, capture_output=True, text=True, check=True)
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    keys = sum(len([x for x in v if x.startswith("CompileKey")]) for v in result.values())
    refusals = sum(len([x for x in v if not x.startswith("CompileKey")]) for v in result.values())
    print(f"{len(result)} calls, {keys} keys, {refusals} refusals -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
