"""The argument records every attention kernel's `__call__` takes, by name.

Host code builds one record per launch (`flash_cute.runtime.launch`); a kernel reads the fields it
uses (``args.q``, ``args.seqused_k``) and ignores the rest, so a new optional field (a page
table, split outputs, aux tensors) is one line here and a read in the kernels that use it.
At the TVM-FFI boundary the record is passed field by field
(`flash_cute.runtime.jit.launch_kernel`): a tuple argument would be converted to an ffi.Array on
every call.

Each field holds, at run time, a `jit.TensorArg` (a torch tensor and the alignment the kernel
may assume), a Python float (a Float32 parameter), an int (Int32) or None (an absent optional
tensor); when compiling, the matching fake tensor or DSL scalar (`tools.fake_args`). Plain
Python: no torch, no CuTe DSL.
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
    rng_seed: Optional[Any] = None  # dropout: int32 [2], the Philox key, or [12] / [14]
                                    # with a frame (`flash_cute.reference.rng`)
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
    # With the append: int64 [1], the device's dropped-rows counter; the kernel adds the new
    # rows it drops (outside the cache, or through a page entry that is not one of its pages).
    append_dropped: Optional[Any] = None
    # Traced mods (`Variant.mods`): the tensors they capture, contiguous, in `KernelMods.aux`
    # order (`kernel_view.MAX_AUX` slots; unused ones None).
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
    # Split-KV merged by the forward itself (`launch_fwd.ForwardLaunch`'s `merge_in_kernel`): out
    # and lse above are the partials, merged_out / merged_lse O and LSE, split_counts int32
    # [b * heads of a split * query tiles], zero before and after each launch.
    merged_out: Optional[Any] = None
    merged_lse: Optional[Any] = None
    split_counts: Optional[Any] = None
    # The measured timeline (`Variant.timeline`): int64 [ctas, warps, SLOTS, 3] records of the
    # first `ctas` CTAs' first tiles (`flash_cute.contract.timeline`).
    timeline: Optional[Any] = None
    # The FP8 forward (e4m3 q, k, v; out bf16 or fp16): float32 [b, hk] factors of Q, K and V
    # per (batch entry, K/V head), FA3's descales (1.0 where the caller gave none).
    q_descale: Optional[Any] = None
    k_descale: Optional[Any] = None
    v_descale: Optional[Any] = None


class BwdArgs(NamedTuple):
    """An attention backward main kernel: q/dout like q, k/v like k, dk/dv [.., h, d] (per query
    head; dtype, or fp32 for GQA), lse_log2 and delta like the forward's lse (`bwd_prep`),
    dq_accum in the layout of the arch's `launch_bwd.BackwardPlan.dq_accum`, dq_semaphores
    (deterministic only) int32 [b, h, ceil(max_seqlen_q / tile_m)]."""
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
    # The measured timeline (`Variant.timeline`): as `FwdArgs.timeline`, a block being a
    # query tile.
    timeline: Optional[Any] = None


AUX_FIELDS = ("aux0", "aux1", "aux2", "aux3")
SCALAR_FIELDS = ("scalar0", "scalar1", "scalar2", "scalar3")
# Bytes per element of the captured tensors' dtypes (`kernel_view.AUX_DTYPES` names): the
# alignment a kernel may assume of their data pointers.
AUX_ALIGN = {"fp32": 4, "fp16": 2, "bf16": 2, "i32": 4, "i64": 8, "u8": 1}


def aux_fields(tensors) -> dict:
    """The aux fields of a record for a call's captured tensors (`jit.TensorArg`s or fakes)."""
    return dict(zip(AUX_FIELDS, tuple(tensors) + (None,) * (len(AUX_FIELDS) - len(tensors))))


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


