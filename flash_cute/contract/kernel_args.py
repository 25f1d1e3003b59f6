"""The argument records every attention kernel's `__call__` takes, by name.

Host code builds one record per launch (`flash_cute.runtime.launch`); a kernel reads the fields it
uses (``args.q``, ``args.seqused_k``) and ignores the rest, so a new optional field (a page
table, split outputs, aux tensors) is one line here and a read in the kernels that use it.
At the TVM-FFI boundary the record is passed field by field (`flash_cute.runtime.jit.launch_kernel`):
a tuple argument would be converted to an ffi.Array on every call.

Each field holds, at run time, a `jit.TensorArg` (a torch tensor and the alignment the kernel
may assume), a Python float (a Float32 parameter), an int (Int32) or None (an absent optional
tensor); when compiling, the matching fake tensor or DSL scalar (`fake_forward_args`,
`fake_backward_args`). No CuTe DSL import at module level.
"""

from typing import Any, NamedTuple, Optional


class FwdArgs(NamedTuple):
    """An attention forward. Padded: q [b, sq, h, d], k/v [b, sk, hk, d], lse [b, h, sq].
    Varlen: q [tq, h, d], k/v [tk, hk, d], lse [h, tq], cu_seqlens [b + 1]. seqused [b]."""
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    softmax_scale: Any
    softcap: Any  # the cap (1.0 when the variant has none)
    window_left: Any
    window_right: Any
    max_seqlen_q: Any
    cu_seqlens_q: Optional[Any] = None
    cu_seqlens_k: Optional[Any] = None
    seqused_q: Optional[Any] = None
    seqused_k: Optional[Any] = None
    rng_seed: Optional[Any] = None  # dropout: int32 [2], the Philox key (`flash_cute.reference.rng`)
    keep_threshold: Any = 0  # dropout: rng.keep_threshold(p) << 16, as an int32
    dropout_scale: Any = 1.0  # dropout: 1 / (1 - p)
    # Split-KV (`Variant.split_kv`): out and lse are the per-split partials, out fp32
    # [splits, *O's shape], lse [splits, *LSE's shape]; `block_range.split_range` splits.
    num_splits: Any = 1
    blocks_per_split: Any = 0
    # Paged K/V (`Variant.page_size`): k, v [pages, page_size, hk, d] (also when q is varlen;
    # cu_seqlens_k is then None) and the page table int32 [b, max_pages].
    page_table: Optional[Any] = None
    # In-place append (`Variant.append`, padded k only): k_new [b, s_new, hk, d] and v_new
    # [b, s_new, hk, dv], written into k / v (dense or paged) at rows seqused_k[b] - s_new ..
    # seqused_k[b] - 1 of sequence b before they are read.
    k_new: Optional[Any] = None
    v_new: Optional[Any] = None
    # Traced mods (`Variant.mods`): the tensors they capture, contiguous, in `KernelMods.aux`
    # order (`mod_graph.MAX_AUX` slots; unused ones None).
    aux0: Optional[Any] = None
    aux1: Optional[Any] = None
    aux2: Optional[Any] = None
    aux3: Optional[Any] = None
    # A block mask (`KernelMods.sparse`): int32 [b, h, query tiles, key tiles] states of the
    # kernel's tiles and [b, h, tiles, 4] ranges of non-empty tiles and of the longest run of
    # full ones, per query tile here (`block_mask.kernel_tiles`).
    block_states: Optional[Any] = None
    block_ranges: Optional[Any] = None
    # FA4-form mods' aux_scalars (`Fa4Spec.scalars`): Int32 or Float32 run-time parameters.
    scalar0: Optional[Any] = None
    scalar1: Optional[Any] = None
    scalar2: Optional[Any] = None
    scalar3: Optional[Any] = None
    # Split-KV merged by the forward itself (`launch.ForwardLaunch`'s `merge_in_kernel`): out
    # and lse above are the partials, merged_out / merged_lse O and LSE, split_counts int32
    # [b * heads of a split * query tiles], zero before and after each launch.
    merged_out: Optional[Any] = None
    merged_lse: Optional[Any] = None
    split_counts: Optional[Any] = None


class BwdArgs(NamedTuple):
    """An attention backward main kernel: q/dout like q, k/v like k, dk/dv [.., h, d] (per query
    head; dtype, or fp32 for GQA), lse_log2 and delta like the forward's lse (`bwd_prep`),
    dq_accum in the layout of the arch's `launch.BackwardPlan.dq_accum`, dq_semaphores (deterministic only) int32
    [b, h, ceil(max_seqlen_q / tile_m)]."""
    q: Any
    k: Any
    v: Any
    dout: Any
    lse_log2: Any
    delta: Any
    dq_accum: Any
    dk: Any
    dv: Any
    softmax_scale: Any
    softcap: Any
    window_left: Any
    window_right: Any
    max_seqlen_k: Any
    max_seqlen_q: Any  # queries past it in a sequence count as unused (bounds, `SeqInfo`)
    cu_seqlens_q: Optional[Any] = None
    cu_seqlens_k: Optional[Any] = None
    seqused_q: Optional[Any] = None
    seqused_k: Optional[Any] = None
    dq_semaphores: Optional[Any] = None
    rng_seed: Optional[Any] = None
    keep_threshold: Any = 0
    dropout_scale: Any = 1.0
    aux0: Optional[Any] = None
    aux1: Optional[Any] = None
    aux2: Optional[Any] = None
    aux3: Optional[Any] = None
    # A block mask: as `FwdArgs`'s, the ranges per key tile (the backward's loop).
    block_states: Optional[Any] = None
    block_ranges: Optional[Any] = None
    scalar0: Optional[Any] = None
    scalar1: Optional[Any] = None
    scalar2: Optional[Any] = None
    scalar3: Optional[Any] = None


AUX_FIELDS = ("aux0", "aux1", "aux2", "aux3")
SCALAR_FIELDS = ("scalar0", "scalar1", "scalar2", "scalar3")
# Bytes per element of the captured tensors' dtypes (`mod_graph.AUX_DTYPES` names): the
# alignment a kernel may assume of their data pointers.
AUX_ALIGN = {"fp32": 4, "fp16": 2, "bf16": 2, "i32": 4, "i64": 8, "u8": 1}


def aux_fields(tensors) -> dict:
    """The aux fields of a record for a call's captured tensors (`jit.TensorArg`s or fakes)."""
    return dict(zip(AUX_FIELDS, tuple(tensors) + (None,) * (len(AUX_FIELDS) - len(tensors))))


def fake_aux(mods) -> dict:
    """Fake aux fields for a `KernelMods` (None: no mods): dynamic extents, compact."""
    if mods is None:
        return {}
    import cutlass

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    dsl = {"fp32": cutlass.Float32, "fp16": cutlass.Float16, "bf16": cutlass.BFloat16,
           "i32": cutlass.Int32, "i64": cutlass.Int64, "u8": cutlass.Uint8}
    fakes = [fake_tensor(dsl[name], tuple(dynamic_dim() for _ in range(rank)),
                         align=AUX_ALIGN[name]) for name, rank in mods.aux]
    # A backward's gradients of learnable captured tensors, fp32, after them.
    fakes += [fake_tensor(cutlass.Float32, tuple(dynamic_dim() for _ in range(mods.aux[a][1])),
                          align=4) for a in getattr(mods, "grad_slots", ())]
    fields = aux_fields(fakes)
    if mods.sparse:
        for name in ("block_states", "block_ranges"):
            fields[name] = fake_tensor(cutlass.Int32, tuple(dynamic_dim() for _ in range(4)),
                                       align=4)
    for name, kind in zip(SCALAR_FIELDS, getattr(mods, "scalars", ())):
        fields[name] = getattr(cutlass, kind)(0)
    return fields


def score_scalars(problem) -> dict:
    """The scalar fields of a validated `AttentionProblem`, cast (a float or int slot is fixed
    by the first compile of each key)."""
    return {"softmax_scale": float(problem.softmax_scale),
            "softcap": float(problem.softcap) if problem.softcap > 0 else 1.0,
            "window_left": int(problem.window_left or 0),
            "window_right": int(problem.window_right or 0)}


def dropout_scalars(problem) -> dict:
    """The dropout fields' scalars of a validated problem (p = 0: the defaults, unread)."""
    from flash_cute.contract.constants import keep_threshold

    p = problem.dropout_p
    if p <= 0:
        return {"keep_threshold": 0, "dropout_scale": 1.0}
    # The kernels compare as unsigned; an int32 slot carries the bits.
    bits = keep_threshold(p) << 16
    return {"keep_threshold": bits - (1 << 32) if bits >= 1 << 31 else bits,
            "dropout_scale": 1.0 / (1.0 - p)}


def _fake_dropout(dropout: bool) -> dict:
    from cutlass import Float32, Int32

    from flash_cute.runtime.jit import fake_tensor

    return {"rng_seed": fake_tensor(Int32, (2,), align=4) if dropout else None,
            "keep_threshold": Int32(0), "dropout_scale": Float32(1.0)}


def _fake_layout(varlen: bool):
    """Dynamic extents of a fake launch: (Q rows, K rows, heads, kv heads, per-row vector shape
    [b, h, sq] or [h, tq], cu_seqlens pair or (None, None)), padded or varlen."""
    from cutlass import Int32

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    heads, heads_kv = dynamic_dim(), dynamic_dim()
    if varlen:
        rows_q, rows_k, batch1 = (dynamic_dim(),), (dynamic_dim(),), dynamic_dim()
        cu = (fake_tensor(Int32, (batch1,), align=4), fake_tensor(Int32, (batch1,), align=4))
        return rows_q, rows_k, heads, heads_kv, (heads, rows_q[0]), cu
    batch, seqlen_q, seqlen_k = dynamic_dim(), dynamic_dim(), dynamic_dim()
    return (batch, seqlen_q), (batch, seqlen_k), heads, heads_kv, (batch, heads, seqlen_q), \
        (None, None)


def _fake_seqused(seqused_q: bool, seqused_k: bool) -> tuple:
    from cutlass import Int32

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    return tuple(fake_tensor(Int32, (dynamic_dim(),), align=4) if used else None
                 for used in (seqused_q, seqused_k))


def _fake_scalars() -> dict:
    from cutlass import Float32, Int32

    return {"softmax_scale": Float32(0.125), "softcap": Float32(1.0), "window_left": Int32(0),
            "window_right": Int32(0)}


def fake_forward_args(dtype, hdim: int, hdim_v: int, varlen: bool,
                      seqused=(False, False), dropout: bool = False,
                      split_kv: bool = False, paged: bool = False,
                      append: bool = False, mods=None, merged: bool = False) -> FwdArgs:
    """A forward record of fake tensors with dynamic batch, heads and lengths, padded or
    varlen, for cross-compiling; `seqused`: (seqused_q, seqused_k) given; `dropout`: with
    the seed tensor; `split_kv`: out and lse as fp32 partials with a leading split mode;
    `paged`: k and v as paged caches with a page table; `append`: with k_new / v_new;
    `mods`: a `KernelMods`, with its aux tensors; `merged` (with `split_kv`): the merged O
    and LSE and the split counts of a kernel that merges its splits itself."""
    from cutlass import Float32, Int32

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    rows_q, rows_k, heads, heads_kv, lse_shape, cu = _fake_layout(varlen)
    used_q, used_k = _fake_seqused(*seqused)
    splits, out_dtype = ((dynamic_dim(),), Float32) if split_kv else ((), dtype)
    table = None
    if paged:
        rows_k, cu = (dynamic_dim(), dynamic_dim()), (cu[0], None)
        table = fake_tensor(Int32, (dynamic_dim(), dynamic_dim()), align=4)
    new = (None, None)
    if append:
        rows_new = (dynamic_dim(), dynamic_dim())
        new = (fake_tensor(dtype, rows_new + (heads_kv, hdim)),
               fake_tensor(dtype, rows_new + (heads_kv, hdim_v)))
    return FwdArgs(
        q=fake_tensor(dtype, rows_q + (heads, hdim)),
        k=fake_tensor(dtype, rows_k + (heads_kv, hdim)),
        v=fake_tensor(dtype, rows_k + (heads_kv, hdim_v)),
        out=fake_tensor(out_dtype, splits + rows_q + (heads, hdim_v)),
        lse=fake_tensor(Float32, splits + lse_shape, align=4), **_fake_scalars(),
        max_seqlen_q=Int32(1), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], seqused_q=used_q,
        seqused_k=used_k, **_fake_dropout(dropout), num_splits=Int32(1),
        blocks_per_split=Int32(0), page_table=table, k_new=new[0], v_new=new[1],
        **fake_aux(mods), **(_fake_merged(dtype, rows_q, heads, hdim_v, lse_shape)
                             if merged else {}))


def _fake_merged(dtype, rows_q, heads, hdim_v, lse_shape) -> dict:
    from cutlass import Float32, Int32

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    return dict(merged_out=fake_tensor(dtype, rows_q + (heads, hdim_v)),
                merged_lse=fake_tensor(Float32, lse_shape, align=4),
                split_counts=fake_tensor(Int32, (dynamic_dim(),), align=4))


def fake_backward_args(dtype, hdim: int, hdim_v: int, varlen: bool, *, seqused=(False, False),
                       dkv_fp32: bool = False, stats_align: int = 4, dq_align: int = 4,
                       dq_accum_cols: Optional[int] = None,
                       semaphores: bool = False, dropout: bool = False,
                       mods=None) -> BwdArgs:
    """A backward record of fake tensors, as `fake_forward_args`. The alignments are those the
    arch's launch promises (`launch.BackwardPlan`); `dq_accum_cols`: dQaccum as [.., h, cols]
    fragment-order tiles (`arch.hopper.dq_accum`) instead of laid out like q; `semaphores`:
    the deterministic backward's dQ semaphores; `mods`: a `KernelMods`, with its aux
    tensors."""
    from cutlass import Float32, Int32

    from flash_cute.runtime.jit import dynamic_dim, fake_tensor

    rows_q, rows_k, h, hk, stats, cu = _fake_layout(varlen)
    dkv_dtype, dkv_align = (Float32, 4) if dkv_fp32 else (dtype, 16)
    used_q, used_k = _fake_seqused(*seqused)
    if dq_accum_cols is None:
        dq_accum = fake_tensor(Float32, rows_q + (h, hdim), align=dq_align)
    else:
        lead = (dynamic_dim(),) if varlen else (dynamic_dim(), dynamic_dim())
        dq_accum = fake_tensor(Float32, lead + (h, dq_accum_cols), align=dq_align)
    sem = fake_tensor(Int32, (dynamic_dim(), h, dynamic_dim()), align=4) if semaphores else None
    return BwdArgs(
        q=fake_tensor(dtype, rows_q + (h, hdim)), k=fake_tensor(dtype, rows_k + (hk, hdim)),
        v=fake_tensor(dtype, rows_k + (hk, hdim_v)), dout=fake_tensor(dtype, rows_q + (h, hdim_v)),
        lse_log2=fake_tensor(Float32, stats, align=stats_align),
        delta=fake_tensor(Float32, stats, align=stats_align), dq_accum=dq_accum,
        dk=fake_tensor(dkv_dtype, rows_k + (h, hdim), align=dkv_align),
        dv=fake_tensor(dkv_dtype, rows_k + (h, hdim_v), align=dkv_align), **_fake_scalars(),
        max_seqlen_k=Int32(1), max_seqlen_q=Int32(1), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
        seqused_q=used_q,
        seqused_k=used_k, dq_semaphores=sem, **_fake_dropout(dropout), **fake_aux(mods))
