"""The API fuzz's calls: a Hypothesis strategy that draws a plain spec (ints, bools, strings:
printable, shrinkable, kept as a regression example), and `run(spec)`, which builds the
tensors from the spec's seed, makes the call and checks it.

Kinds: `flash_attn_func` (masks, GQA, views, splits, Flex mods, ALiBi, block masks, sinks,
dropout, the backward), `flash_attn_varlen_func` (packed with empty sequences and uncovered
rows, or padded with seqused), paged reads through either, `flash_attn_with_kvcache`
(dense, paged, cache_batch_idx, cache_leftpad, appends, rotary), `flash_attn_combine` and
flash_attn 2's packed functions. A spec with `corrupt` set carries one bad index content:
the call must raise ValueError naming the argument, the caches bitwise unchanged. Otherwise
out, LSE (and gradients) must meet the FlashAttention rule against `fuzz_model` in float64,
and the cache must equal the model's append.
"""

import math

import fuzz_model as model
import torch
from hypothesis import strategies as st

import flash_cute
from flash_cute import flash_attn_interface as fa2
from flash_cute.reference.attention import tolerance_check
from flash_cute.reference.rng import draw_seed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LENGTHS = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 13, 16, 17, 31])


def _score_mod(score, b, h, q_idx, kv_idx):
    return score + 0.05 * (q_idx - kv_idx) - 0.1 * h


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx + b) % 3 != 1


# ---------------------------------------------------------------------------------- drawing


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["func", "func", "varlen", "varlen", "paged", "kvcache",
                                 "kvcache", "kvcache", "combine", "fa2"]))
    spec = dict(kind=kind, seed=draw(st.integers(0, 2**16)),
                dtype=draw(st.sampled_from(sorted(DTYPES))),
                d=draw(st.sampled_from([16, 32, 64])), hk=draw(st.sampled_from([1, 2])),
                group=draw(st.sampled_from([1, 2, 3])), causal=draw(st.booleans()),
                softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])),
                splits=draw(st.sampled_from([1, 1, 0, 2, 3])), corrupt=None)
    spec["window"] = (None, None) if spec["causal"] or draw(st.integers(0, 3)) else \
        (draw(st.sampled_from([None, 0, 3])), draw(st.sampled_from([None, 0, 2])))
    drawer = {"func": _func, "varlen": _varlen, "paged": _paged, "kvcache": _kvcache,
              "combine": _combine, "fa2": _fa2}[kind]
    drawer(draw, spec)
    if spec.get("mod") in ("score", "both", "alibi") or spec.get("alibi"):
        spec["softcap"] = 0.0     # refused: the softcap is written inside a score_mod
    return spec


def _corrupt(draw, spec, names):
    """About one in four calls of a kind with index tensors carries one bad content: a coin,
    not `integers(0, 3) == 0`, whose share moves with the modules loaded in the process
    (docs/decisions.md, D-FUZZ-COIN)."""
    if names and draw(st.sampled_from((False, True))):
        spec["corrupt"] = draw(st.sampled_from(names))


def _func(draw, spec):
    spec.update(b=draw(st.integers(1, 3)), sq=draw(LENGTHS.filter(bool)),
                sk=draw(LENGTHS.filter(bool)), view=draw(st.sampled_from(
                    ["contiguous", "heads", "transposed"])),
                mod=draw(st.sampled_from(["none"] * 3 + ["score", "mask", "both", "alibi",
                                                         "block"])),
                sink=draw(st.booleans()), dropout=draw(st.sampled_from([0.0, 0.0, 0.2])),
                bwd=draw(st.booleans()))


def _varlen(draw, spec):
    b = draw(st.integers(1, 4))
    spec.update(packed=draw(st.booleans()), lens_q=draw(st.lists(LENGTHS, min_size=b,
                                                                  max_size=b)),
                lens_k=draw(st.lists(LENGTHS, min_size=b, max_size=b)),
                trailing=draw(st.sampled_from([0, 0, 3])),
                seqused_q=draw(st.booleans()), seqused_k=draw(st.booleans()),
                mod=draw(st.sampled_from(["none", "none", "score", "mask", "alibi"])),
                sink=draw(st.booleans()), dropout=draw(st.sampled_from([0.0, 0.0, 0.2])),
                bwd=draw(st.booleans()))
    if not spec["packed"]:
        spec["trailing"] = 0
        spec["seqused_k"] = True
    names = ["seqused_k_past_span", "seqused_negative"] if spec["seqused_k"] else []
    if spec["packed"]:
        names += ["cu_start", "cu_decreasing", "cu_past_end"]
        names += ["max_seqlen_q"] if max(spec["lens_q"]) > 0 else []
    _corrupt(draw, spec, names)


def _paged(draw, spec):
    b = draw(st.integers(1, 3))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    spec.update(api=draw(st.sampled_from(["func", "varlen"])), b=b, page=page,
                slots=draw(st.integers(1, 4)), spare=draw(st.integers(0, 3)),
                sq=draw(LENGTHS.filter(bool)), lens=draw(st.lists(st.integers(0, 32),
                                                                  min_size=b, max_size=b)),
                pad_unused=draw(st.booleans()))
    names = ["page_entry_past", "page_entry_negative"]
    if spec["api"] == "varlen":
        names.append("seqused_k_past_span")
    _corrupt(draw, spec, names)


def _kvcache(draw, spec):
    b = draw(st.integers(1, 3))
    spec.update(b=b, sq=draw(st.integers(1, 4)), new=draw(st.sampled_from([0, 0, 1, 2, 3])),
                layout=draw(st.sampled_from(["dense", "paged", "batch_idx", "leftpad"])),
                page=draw(st.sampled_from([2, 4, 8])), slots=draw(st.integers(1, 4)),
                capacity=draw(st.integers(1, 24)), fill=draw(st.lists(
                    st.floats(0, 1), min_size=b, max_size=b)),
                rotary=draw(st.sampled_from(["none", "none", "interleaved", "halves"])),
                alibi=draw(st.integers(0, 4)) == 0, int_seqlens=draw(st.integers(0, 5)) == 0,
                lse=draw(st.booleans()))
    room = spec["slots"] * spec["page"] if spec["layout"] == "paged" else spec["capacity"]
    if spec["new"] > room:
        # An append longer than the whole cache is a read: the corruptions below are drawn
        # for the call that runs.
        spec["new"] = 0
    names = ["seqlens_negative", "append_past" if spec["new"] else "read_past"]
    if spec["layout"] == "paged":
        names += ["block_entry_past", "block_entry_negative"]
        if spec["new"]:
            names.append("shared_write_page")
    if spec["layout"] == "batch_idx":
        names += ["batch_idx_past"] + (["batch_idx_repeat"] if spec["new"] and b > 1 else [])
    if spec["layout"] == "leftpad":
        names.append("leftpad_past")
    if spec["rotary"] != "none":
        names.append("rotary_short")
    if spec["int_seqlens"]:
        names = ["append_past" if spec["new"] else "read_past"]
    _corrupt(draw, spec, names)


def _combine(draw, spec):
    spec.update(parts=draw(st.integers(1, 4)), b=draw(st.integers(1, 3)),
                s=draw(st.integers(1, 9)), varlen=draw(st.booleans()),
                dead=draw(st.integers(0, 3)))


def _fa2(draw, spec):
    spec.update(fn=draw(st.sampled_from(["qkvpacked", "kvpacked", "varlen_qkvpacked"])),
                b=draw(st.integers(1, 3)), s=draw(LENGTHS.filter(bool)),
                lens=draw(st.lists(LENGTHS, min_size=1, max_size=3)),
                dropout=draw(st.sampled_from([0.0, 0.0, 0.2])))
    spec["hk"] = spec["hk"] * spec["group"]   # packed qkv: one head count
    spec["group"] = 1


# ---------------------------------------------------------------------------------- running


class Expected(Exception):
    """A documented refusal of a corrupted call."""


def run(spec) -> str:
    """Make and check one call; returns "valid" or "invalid" (what it was)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    runner = {"func": _run_func, "varlen": _run_varlen, "paged": _run_paged,
              "kvcache": _run_kvcache, "combine": _run_combine, "fa2": _run_fa2}
    runner[spec["kind"]](spec, gen)
    return "valid" if spec["corrupt"] is None else "invalid"


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _heads(spec):
    return spec["hk"] * spec["group"], spec["hk"]


def _view(t, how):
    """t [b, s, h, d] as a strided view holding the same values."""
    if how == "heads":
        wide = torch.zeros(*t.shape[:2], t.shape[2] + 1, t.shape[3], dtype=t.dtype)
        wide[:, :, :t.shape[2]] = t
        return wide[:, :, :t.shape[2]]
    if how == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t


def _mods(spec, gen, b, h, sq, sk):
    """(kwargs for the call, kwargs for the model) of the spec's mod."""
    mod = spec.get("mod", "none")
    if mod == "alibi":
        slopes = torch.rand(h, generator=gen) * 0.5
        return dict(alibi_slopes=slopes), dict(alibi=slopes.double())
    call, ref = {}, {}
    if mod in ("score", "both"):
        call["score_mod"] = ref["score_mod"] = _score_mod
    if mod in ("mask", "both"):
        call["mask_mod"] = ref["mask_mod"] = _mask_mod
    if mod == "block":
        call["block_mask"] = flash_cute.create_block_mask(_mask_mod, b, None, sq, sk,
                                                          device="cpu", BLOCK_SIZE=8)
        ref["mask_mod"] = _mask_mod
    return call, ref


def _rule(name, ours, ref64, native, atol=None, scale=None):
    """The FlashAttention rule; `scale` adds a floor of one unit of the dtype's precision at
    that magnitude (gradients whose reference is exactly 0, as dq with one key, are then
    not failed for fp32 rounding)."""
    if scale is not None:
        atol = tolerance_check(ours, ref64, native).atol + scale * torch.finfo(ours.dtype).eps
    res = tolerance_check(ours, ref64, native, atol=atol)
    assert res.ok, (f"{name}: error {res.err:.3e} against float64, the "
                    f"{native.dtype} model's {res.err_native:.3e} (+ {res.atol:.1e})")


def _check(outs, seqs, kw, dtype, dout=None, grads=None):
    """out and lse by the FlashAttention rule against the model in float64 (the model in
    `dtype` gives the allowed error); with `grads`, dq, dk, dv of sum(out * dout) too.
    `seqs(dt, grad)`: dict(leaves=q, k, v cast to dt, seqs=[(b, q_b, k_b, v_b)], assemble=a
    function of the per-sequence (out, lse) to the call's layout)."""
    out, lse = outs
    ref, nat = (_model(seqs(dt), kw, dt) for dt in (torch.float64, dtype))
    _rule("out", out, ref[0], nat[0])
    if lse is not None:
        _rule("lse", lse, ref[1], nat[1], atol=1e-4)
    if grads is None:
        return
    model_grads = []
    for dt in (torch.float64, dtype):
        pieces = seqs(dt, True)
        (_model(pieces, kw, dt)[0].double() * dout.double()).sum().backward()
        model_grads.append([t.grad for t in pieces["leaves"]])
    scale = max(float(g.abs().max()) if g.numel() else 0.0 for g in model_grads[0])
    for name, ours, want, native in zip("qkv", grads, *model_grads):
        _rule(f"d{name}", ours, want, native, scale=scale)


def _model(pieces, kw, dtype):
    return pieces["assemble"](
        [model.attend(q, k, v, seq=b, dtype=dtype, **kw) for b, q, k, v in pieces["seqs"]])


def _seeded(spec):
    """(call kwargs, model kwargs) of dropout: the call draws its seed from torch's CPU
    generator, which the test seeds and replays."""
    p = spec.get("dropout", 0.0)
    if not p:
        return {}, {}
    torch.manual_seed(spec["seed"])
    seed = draw_seed("cpu")
    torch.manual_seed(spec["seed"])
    return dict(dropout_p=p), dict(dropout=(p, seed))


def _extras(spec, gen, b, h, d, sq, sk):
    """A call's mods, sink and dropout: (the call's keywords for mods and sink, its dropout
    keywords, the model's keywords)."""
    call, ref = _mods(spec, gen, b, h, sq, sk)
    if spec["sink"]:
        call["learnable_sink"] = torch.randn(h, generator=gen)
        ref["sink"] = call["learnable_sink"].double()
    drop_call, drop_ref = _seeded(spec)
    kw = dict(scale=1.0 / math.sqrt(d), causal=spec["causal"], window=spec["window"],
              softcap=spec["softcap"], **ref, **drop_ref)
    return call, drop_call, kw


def _stack(parts):
    """Per-sequence (out [s, h, d], lse [h, s]) of equal lengths -> padded layouts."""
    return torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])


def _run_func(spec, gen):
    dtype = DTYPES[spec["dtype"]]
    b, sq, sk, d = spec["b"], spec["sq"], spec["sk"], spec["d"]
    h, hk = _heads(spec)
    q, k, v = (_randn(gen, b, n, heads, d, dtype=dtype)
               for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    call, drop_call, kw = _extras(spec, gen, b, h, d, sq, sk)
    leaves = [t.clone().requires_grad_(spec["bwd"]) for t in (q, k, v)]
    out, lse = flash_cute.flash_attn_func(
        *(_view(t, spec["view"]) for t in leaves), causal=spec["causal"],
        window_size=spec["window"], softcap=spec["softcap"], num_splits=spec["splits"],
        return_lse=True, **call, **drop_call)

    def seqs(dt, grad=False):
        ls = [t.to(dt).requires_grad_(grad) for t in (q, k, v)]
        return dict(leaves=ls, seqs=[(i, ls[0][i], ls[1][i], ls[2][i]) for i in range(b)],
                    assemble=_stack)
    grads = dout = None
    if spec["bwd"]:
        dout = _randn(gen, *out.shape, dtype=dtype)
        out.backward(dout)
        grads = [t.grad for t in leaves]
    _check((out, lse), seqs, kw, dtype, dout, grads)


def _offsets(lengths, trailing=0):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32), cu[-1] + trailing


def _run_varlen(spec, gen):
    dtype = DTYPES[spec["dtype"]]
    h, hk = _heads(spec)
    d, lens_q, lens_k = spec["d"], spec["lens_q"], spec["lens_k"]
    b = len(lens_q)
    packed = spec["packed"]
    if packed:
        cu_q, total_q = _offsets(lens_q, spec["trailing"])
        cu_k, total_k = _offsets(lens_k)
        q = _randn(gen, total_q, h, d, dtype=dtype)
        k, v = (_randn(gen, total_k, hk, d, dtype=dtype) for _ in range(2))
        span_q, span_k = lens_q, lens_k
    else:
        cu_q = cu_k = None
        sq, sk = max(max(lens_q), 1), max(max(lens_k), 1)
        q = _randn(gen, b, sq, h, d, dtype=dtype)
        k, v = (_randn(gen, b, sk, hk, d, dtype=dtype) for _ in range(2))
        span_q, span_k = [sq] * b, [sk] * b
    used_q = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in span_q]
    used_k = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in span_k]
    lengths = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32) if spec["seqused_q"]
                   else None,
                   seqused_k=torch.tensor(used_k, dtype=torch.int32) if spec["seqused_k"]
                   else None)
    eff_q = used_q if spec["seqused_q"] else span_q
    eff_k = used_k if spec["seqused_k"] else span_k
    max_q, max_k = max(span_q + [1]), max(span_k + [1])
    call, drop_call, kw = _extras(spec, gen, b, h, d, 0, 0)
    corrupt = spec["corrupt"]
    if corrupt:
        name = _corrupt_varlen(corrupt, lengths, cu_q, cu_k, span_k, gen)
        cu_q, cu_k = lengths.pop("cu_q", cu_q), lengths.pop("cu_k", cu_k)
        if corrupt == "max_seqlen_q":
            lengths["seqused_q"] = None    # the longest span is then a used length
            max_q = max(span_q) - 1
        _expect_refusal(lambda: flash_cute.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q if packed else
            None, max_seqlen_k=max_k if packed else None, causal=spec["causal"],
            window_size=spec["window"], **lengths, **call), name)
        return
    leaves = [t.clone().requires_grad_(spec["bwd"]) for t in (q, k, v)]
    out, lse = flash_cute.flash_attn_varlen_func(
        *leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q if packed else None,
        max_seqlen_k=max_k if packed else None, causal=spec["causal"],
        window_size=spec["window"], softcap=spec["softcap"], num_splits=spec["splits"],
        return_lse=True, **lengths, **call, **drop_call)

    def seqs(dt, grad=False):
        ls = [t.to(dt).requires_grad_(grad) for t in (q, k, v)]
        if packed:
            starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
            pieces = [(i, ls[0][starts_q[i]:starts_q[i] + eff_q[i]],
                       ls[1][starts_k[i]:starts_k[i] + eff_k[i]],
                       ls[2][starts_k[i]:starts_k[i] + eff_k[i]]) for i in range(b)]
        else:
            pieces = [(i, ls[0][i, :eff_q[i]], ls[1][i, :eff_k[i]], ls[2][i, :eff_k[i]])
                      for i in range(b)]
        return dict(leaves=ls, seqs=pieces, assemble=lambda parts: _unpad(
            parts, packed, cu_q, q.shape, h, eff_q, dt, call.get("learnable_sink")))
    grads = dout = None
    if spec["bwd"]:
        dout = _randn(gen, *out.shape, dtype=dtype)
        out.backward(dout)
        grads = [t.grad for t in leaves]
    _check((out, lse), seqs, kw, dtype, dout, grads)


def _unpad(parts, packed, cu_q, q_shape, h, eff_q, dt, sink=None):
    """Per-sequence results into the call's layout: rows no sequence uses get out 0 and
    lse -inf (with a learnable sink: the sink's logit, as a row that sees no key)."""
    acc = torch.float64 if dt == torch.float64 else torch.float32
    out = torch.zeros(*q_shape[:-1], parts[0][0].shape[-1] if parts else q_shape[-1],
                      dtype=dt)
    if packed:
        lse = torch.full((h, q_shape[0]), -math.inf, dtype=acc)
        for i, (o, s) in enumerate(parts):
            at = int(cu_q[i])
            out[at:at + eff_q[i]] = o
            lse[:, at:at + eff_q[i]] = s
    else:
        lse = torch.full((q_shape[0], h, q_shape[1]), -math.inf, dtype=acc)
        for i, (o, s) in enumerate(parts):
            out[i, :eff_q[i]] = o
            lse[i, :, :eff_q[i]] = s
    if sink is not None:
        heads = sink.to(acc)[:, None] if packed else sink.to(acc)[None, :, None]
        lse = torch.where(torch.isneginf(lse), heads.expand_as(lse), lse)
    return out, lse


def _corrupt_varlen(corrupt, lengths, cu_q, cu_k, span_k, gen):
    """Apply one bad content; returns the argument the error must name."""
    if corrupt == "seqused_k_past_span":
        b = int(torch.randint(0, len(span_k), (1,), generator=gen))
        lengths["seqused_k"][b] = span_k[b] + 1
        return "seqused_k"
    if corrupt == "seqused_negative":
        lengths["seqused_k"][0] = -1
        return "seqused_k"
    if corrupt == "cu_start":
        lengths["cu_q"] = cu_q + 1
        return "cu_seqlens_q"
    if corrupt == "cu_decreasing":
        bad = cu_k.clone()
        bad[1] = bad[-1] + 1 if len(bad) > 2 else -1
        lengths["cu_k"] = bad
        return "cu_seqlens_k"
    if corrupt == "cu_past_end":
        bad = cu_k.clone()
        bad[-1] += 1
        lengths["cu_k"] = bad
        return "cu_seqlens_k"
    return "max_seqlen_q"


def _expect_refusal(fn, name, caches=()):
    """The call raises ValueError naming `name`, before touching `caches`."""
    before = [c.clone() for c in caches]
    try:
        fn()
    except ValueError as err:
        assert name in str(err), f"the error does not name {name}: {err}"
    else:
        raise AssertionError(f"a bad {name} was not refused")
    for c, was in zip(caches, before):
        assert torch.equal(c, was), "a refused call changed the cache"


def _run_paged(spec, gen):
    """A paged read: flash_attn_func (every row of the pages is a key) or
    flash_attn_varlen_func with seqused_k; unused table entries padded with -1 or not."""
    dtype = DTYPES[spec["dtype"]]
    h, hk = _heads(spec)
    b, page, slots, d = spec["b"], spec["page"], spec["slots"], spec["d"]
    num_pages = b * slots + spec["spare"]
    kc, vc = (_randn(gen, num_pages, page, hk, d, dtype=dtype) for _ in range(2))
    table = torch.randperm(num_pages, generator=gen)[:b * slots].view(b, slots).int()
    capacity = slots * page
    used = [min(n, capacity) for n in spec["lens"]]
    varlen = spec["api"] == "varlen"
    if not varlen:
        used = [capacity] * b
    if spec["pad_unused"] and varlen:
        for i in range(b):
            table[i, -(-used[i] // page):] = -1
    q = _randn(gen, b, spec["sq"], h, d, dtype=dtype)
    call = dict(page_table=table, causal=spec["causal"], window_size=spec["window"],
                softcap=spec["softcap"], num_splits=spec["splits"], return_lse=True)
    if varlen:
        call["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    fn = flash_cute.flash_attn_varlen_func if varlen else flash_cute.flash_attn_func
    corrupt = spec["corrupt"]
    if corrupt:
        row = int(torch.randint(0, b, (1,), generator=gen))
        if corrupt == "seqused_k_past_span":
            call["seqused_k"][row] = capacity + 1
            return _expect_refusal(lambda: fn(q, kc, vc, **call), "seqused_k", (kc, vc))
        if varlen and used[row] == 0:
            call["seqused_k"][row] = used[row] = 1    # the entry must be one the row uses
        slot = int(torch.randint(0, -(-used[row] // page), (1,), generator=gen))
        table[row, slot] = num_pages if corrupt == "page_entry_past" else -1
        return _expect_refusal(lambda: fn(q, kc, vc, **call), "page_table", (kc, vc))
    out, lse = fn(q, kc, vc, **call)
    kw = dict(scale=1.0 / math.sqrt(d), causal=spec["causal"], window=spec["window"],
              softcap=spec["softcap"])

    def seqs(dt, grad=False):
        pieces = [(i, q[i].to(dt), model.logical_rows(kc, table, i)[:used[i]].to(dt),
                   model.logical_rows(vc, table, i)[:used[i]].to(dt)) for i in range(b)]
        return dict(leaves=[], seqs=pieces, assemble=_stack)
    _check((out, lse), seqs, kw, dtype)


def _kv_setup(spec, gen, dtype, h, hk):
    """The caches, their capacity per sequence, the table or entries, and cache_seqlens."""
    b, d, new = spec["b"], spec["d"], spec["new"]
    layout = spec["layout"]
    table = entries = None
    if layout == "paged":
        num_pages = b * spec["slots"] + 1
        kc, vc = (_randn(gen, num_pages, spec["page"], hk, d, dtype=dtype) for _ in range(2))
        table = torch.randperm(num_pages, generator=gen)[:b * spec["slots"]]
        table = table.view(b, spec["slots"]).int()
        capacity = spec["slots"] * spec["page"]
    else:
        cache_batch = b + (1 if layout == "batch_idx" else 0)
        kc, vc = (_randn(gen, cache_batch, spec["capacity"], hk, d, dtype=dtype)
                  for _ in range(2))
        capacity = spec["capacity"]
        if layout == "batch_idx":
            entries = torch.randperm(cache_batch, generator=gen)[:b].int()
    room = max(capacity - new, 0)
    seqlens = [int(f * room) for f in spec["fill"]]
    if spec["int_seqlens"]:
        seqlens = [seqlens[0]] * b
    return kc, vc, capacity, table, entries, seqlens


def _run_kvcache(spec, gen):
    dtype = DTYPES[spec["dtype"]]
    h, hk = _heads(spec)
    b, d, new, sq = spec["b"], spec["d"], spec["new"], spec["sq"]
    kc, vc, capacity, table, entries, seqlens = _kv_setup(spec, gen, dtype, h, hk)
    assert new <= capacity, "the draw keeps appends within the cache"
    q = _randn(gen, b, sq, h, d, dtype=dtype)
    k_new, v_new = (_randn(gen, b, new, hk, d, dtype=dtype) for _ in range(2))
    leftpad = None
    if spec["layout"] == "leftpad":
        leftpad = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in seqlens]
    local = spec["causal"] or spec["window"] != (None, None)
    rows = max(seqlens) + max(new, sq if local else 1)
    cos = sin = None
    if spec["rotary"] != "none":
        half = d // 4
        angles = torch.rand(rows, half, generator=gen) * 6.0
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slopes = torch.rand(h, generator=gen) * 0.5 if spec["alibi"] else None
    name = _corrupt_kvcache(spec, seqlens, capacity, new, table, entries, leftpad, kc.shape[0])
    if name == "rotary_cos":
        cos, sin = cos[:rows - 1], sin[:rows - 1]
    cache_seqlens = seqlens[0] if spec["int_seqlens"] else torch.tensor(seqlens,
                                                                         dtype=torch.int32)
    window = tuple(-1 if w is None else w for w in spec["window"])
    call = dict(k=k_new if new else None, v=v_new if new else None, rotary_cos=cos,
                rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=entries,
                cache_leftpad=None if leftpad is None else torch.tensor(leftpad,
                                                                        dtype=torch.int32),
                block_table=table, causal=spec["causal"], window_size=window,
                softcap=spec["softcap"], rotary_interleaved=spec["rotary"] == "interleaved",
                alibi_slopes=slopes, num_splits=spec["splits"],
                return_softmax_lse=spec["lse"])
    if name:
        return _expect_refusal(lambda: flash_cute.flash_attn_with_kvcache(q, kc, vc, **call),
                               name, (kc, vc))
    starts = torch.tensor(seqlens)
    k_rot, q_rot = k_new, q
    if cos is not None:
        k_pos = starts[:, None] + torch.arange(new)
        k_rot = model.rotate(k_new, cos, sin, k_pos, spec["rotary"] == "interleaved")
        q_pos = starts[:, None] + (torch.arange(sq) if local else torch.zeros(sq, dtype=int))
        q_rot = model.rotate(q, cos, sin, q_pos, spec["rotary"] == "interleaved")
    want_k = model.appended(kc, k_rot, starts, table=table, entries=entries)
    want_v = model.appended(vc, v_new, starts, table=table, entries=entries)
    result = flash_cute.flash_attn_with_kvcache(q, kc, vc, **call)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), "the cache differs"
    out, lse = result if spec["lse"] else (result, None)
    kw = dict(scale=1.0 / math.sqrt(d), causal=spec["causal"], window=spec["window"],
              softcap=spec["softcap"],
              alibi=None if slopes is None else slopes.double())

    def seqs(dt, grad=False):
        pieces = []
        for i in range(b):
            if table is not None:
                keys, values = (model.logical_rows(c, table, i) for c in (want_k, want_v))
            else:
                entry = i if entries is None else int(entries[i])
                keys, values = want_k[entry], want_v[entry]
            lo = 0 if leftpad is None else leftpad[i]
            hi = seqlens[i] + new
            pieces.append((i, q_rot[i].to(dt), keys[lo:hi].to(dt), values[lo:hi].to(dt)))
        return dict(leaves=[], seqs=pieces, assemble=_stack)
    _check((out, lse), seqs, kw, dtype)


def _corrupt_kvcache(spec, seqlens, capacity, new, table, entries, leftpad, cache_batch):
    """Apply the spec's bad content in place; the argument the error must name, or None."""
    corrupt, b = spec["corrupt"], spec["b"]
    if corrupt is None:
        return None
    if corrupt == "seqlens_negative":
        seqlens[-1] = -1
        return "cache_seqlens"
    if corrupt in ("append_past", "read_past"):
        for i in range(b if spec["int_seqlens"] else 1):
            seqlens[i] = capacity - new + 1
        return "cache_seqlens"
    if corrupt in ("block_entry_past", "block_entry_negative"):
        slot = max(-(-(seqlens[0] + new) // spec["page"]) - 1, 0)
        table[0, slot] = table.numel() + 1 if corrupt == "block_entry_past" else -1
        if seqlens[0] + new == 0:
            seqlens[0] = 1 if capacity > new else seqlens[0]
        return "block_table" if seqlens[0] + new > 0 else None
    if corrupt == "shared_write_page":
        if b < 2:
            table[0, seqlens[0] // spec["page"]] = table[0, (seqlens[0] + new - 1) //
                                                          spec["page"]]
            return "block_table" if (seqlens[0] // spec["page"] !=
                                     (seqlens[0] + new - 1) // spec["page"]) else None
        seqlens[1] = seqlens[0]
        table[1] = table[0]
        return "block_table"
    if corrupt == "batch_idx_past":
        entries[0] = cache_batch
        return "cache_batch_idx"
    if corrupt == "batch_idx_repeat":
        entries[1] = entries[0]
        return "cache_batch_idx"
    if corrupt == "leftpad_past":
        leftpad[0] = seqlens[0] + 1
        return "cache_leftpad"
    return "rotary_cos"


def _run_combine(spec, gen):
    """flash_attn_combine against the model's merge: LSE = log sum exp, O weighted."""
    parts, b, s, d = spec["parts"], spec["b"], spec["s"], spec["d"]
    h = spec["hk"] * spec["group"]
    lead = (parts, b * s) if spec["varlen"] else (parts, b, s)
    o = torch.randn(*lead, h, d, generator=gen)
    lse = torch.randn(*lead, h, generator=gen) * 3
    lse[:spec["dead"] % (parts + 1)] = -math.inf     # splits that saw no key
    out, merged = flash_cute.flash_attn_combine(o, lse, out_dtype=DTYPES[spec["dtype"]])
    want_lse = torch.logsumexp(lse.double(), dim=0)
    weights = torch.exp(lse.double() - want_lse).nan_to_num(0.0)
    want = (weights[..., None] * o.double()).sum(0)
    assert torch.allclose(merged.double(), want_lse, atol=1e-5, equal_nan=False) or \
        bool(torch.isneginf(want_lse).all() and torch.isneginf(merged).all())
    tol = 2 * torch.finfo(out.dtype).eps * want.abs().clamp(min=1)
    assert bool(((out.double() - want).abs() <= tol).all()), "combine's O"


def _run_fa2(spec, gen):
    """flash_attn 2's packed functions (their layouts over ours)."""
    dtype = DTYPES[spec["dtype"]]
    h, d = spec["hk"], spec["d"]
    drop_call, drop_ref = _seeded(spec)
    kw = dict(scale=1.0 / math.sqrt(d), causal=spec["causal"], window=spec["window"],
              softcap=spec["softcap"], **drop_ref)
    window = tuple(-1 if w is None else w for w in spec["window"])
    common = dict(causal=spec["causal"], window_size=window, softcap=spec["softcap"],
                  dropout_p=drop_call.get("dropout_p", 0.0), return_attn_probs=True)
    if spec["fn"] == "varlen_qkvpacked":
        cu, total = _offsets(spec["lens"])
        qkv = _randn(gen, total, 3, h, d, dtype=dtype)
        out, lse, _ = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, max(spec["lens"] + [1]),
                                                           **common)
        starts = cu.tolist()

        def seqs(dt, grad=False):
            t = qkv.to(dt)
            pieces = [(i, *(t[starts[i]:starts[i + 1], j] for j in range(3)))
                      for i in range(len(spec["lens"]))]
            return dict(leaves=[], seqs=pieces, assemble=lambda parts: _unpad(
                parts, True, cu, qkv[:, 0].shape, h, spec["lens"], dt))
        return _check((out, lse), seqs, kw, dtype)
    b, s = spec["b"], spec["s"]
    qkv = _randn(gen, b, s, 3, h, d, dtype=dtype)
    if spec["fn"] == "qkvpacked":
        out, lse, _ = fa2.flash_attn_qkvpacked_func(qkv, **common)
    else:
        out, lse, _ = fa2.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **common)

    def seqs(dt, grad=False):
        t = qkv.to(dt)
        return dict(leaves=[], seqs=[(i, t[i, :, 0], t[i, :, 1], t[i, :, 2])
                                     for i in range(b)], assemble=_stack)
    _check((out, lse), seqs, kw, dtype)
