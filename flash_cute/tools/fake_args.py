"""Fake argument records for compiling without tensors (inspect's cross-compiles): every
field of `FwdArgs` / `BwdArgs` as a CuTe DSL fake tensor or scalar, dynamic where a call's
extents are (batch, lengths), compact with the alignment the kernels assume."""

from typing import Optional

import cutlass
from cutlass import Float32, Int32, Int64

from flash_cute.contract.constants import DROPOUT_FRAME
from flash_cute.contract.kernel_args import AUX_ALIGN, SCALAR_FIELDS, BwdArgs, FwdArgs, aux_fields
from flash_cute.contract.timeline import FIELDS, SLOTS
from flash_cute.runtime.jit import dynamic_dim, fake_tensor


def fake_aux(mods) -> dict:
    """Fake aux fields for a `KernelMods` (None: no mods): dynamic extents, compact."""
    if mods is None:
        return {}

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


def _fake_dropout(dropout: bool) -> dict:
    # The int32 view of a seed with its frame (`rng.framed_seed`); a plain seed reads words 0-1.
    words = 2 * (1 + len(DROPOUT_FRAME))
    return {"rng_seed": fake_tensor(Int32, (words,), align=4) if dropout else None,
            "keep_threshold": Int32(0), "dropout_scale": Float32(1.0)}


def _fake_layout(varlen: bool):
    """Dynamic extents of a fake launch: (Q rows, K rows, heads, kv heads, per-row vector shape
    [b, h, sq] or [h, tq], cu_seqlens pair or (None, None)), padded or varlen."""
    heads, heads_kv = dynamic_dim(), dynamic_dim()
    if varlen:
        rows_q, rows_k, batch1 = (dynamic_dim(),), (dynamic_dim(),), dynamic_dim()
        cu = (fake_tensor(Int32, (batch1,), align=4), fake_tensor(Int32, (batch1,), align=4))
        return rows_q, rows_k, heads, heads_kv, (heads, rows_q[0]), cu
    batch, seqlen_q, seqlen_k = dynamic_dim(), dynamic_dim(), dynamic_dim()
    return (batch, seqlen_q), (batch, seqlen_k), heads, heads_kv, (batch, heads, seqlen_q), \
        (None, None)


def _fake_seqused(seqused_q: bool, seqused_k: bool) -> tuple:
    return tuple(fake_tensor(Int32, (dynamic_dim(),), align=4) if used else None
                 for used in (seqused_q, seqused_k))


def _fake_scalars() -> dict:
    return {"softmax_scale": Float32(0.125), "softcap": Float32(1.0), "window_left": Int32(0),
            "window_right": Int32(0)}


def fake_forward_args(dtype, hdim: int, hdim_v: int, varlen: bool,
                      seqused=(False, False), dropout: bool = False,
                      split_kv: bool = False, paged: bool = False,
                      append: bool = False, mods=None, merged: bool = False,
                      timeline: bool = False, out_dtype=None, descales: int = 0) -> FwdArgs:
    """A forward record of fake tensors with dynamic batch, heads and lengths, padded or
    varlen, for cross-compiling; `seqused`: (seqused_q, seqused_k) given; `dropout`: with
    the seed tensor; `split_kv`: out and lse as fp32 partials with a leading split mode;
    `paged`: k and v as paged caches with a page table; `append`: with k_new / v_new;
    `mods`: a `KernelMods`, with its aux tensors; `merged` (with `split_kv`): the merged O
    and LSE and the split counts of a kernel that merges its splits itself; `out_dtype`: O's
    dtype where it is not q's (the FP8 forward); `descales`: the rank of the FP8 forward's
    float32 scales (2: FA3's [b, hk] descales; 3: block scales [b, blocks, heads]; 0: none)."""
    rows_q, rows_k, heads, heads_kv, lse_shape, cu = _fake_layout(varlen)
    used_q, used_k = _fake_seqused(*seqused)
    merged_dtype = out_dtype or dtype   # a split kernel's merged O
    splits, out_dtype = ((dynamic_dim(),), Float32) if split_kv else ((), out_dtype or dtype)
    table = None
    if paged:
        rows_k, cu = (dynamic_dim(), dynamic_dim()), (cu[0], None)
        table = fake_tensor(Int32, (dynamic_dim(), dynamic_dim()), align=4)
    new = (None, None, None)
    if append:
        rows_new = (dynamic_dim(), dynamic_dim())
        new = (fake_tensor(dtype, rows_new + (heads_kv, hdim)),
               fake_tensor(dtype, rows_new + (heads_kv, hdim_v)), fake_tensor(Int64, (1,), align=8))
    return FwdArgs(
        q=fake_tensor(dtype, rows_q + (heads, hdim)),
        k=fake_tensor(dtype, rows_k + (heads_kv, hdim)),
        v=fake_tensor(dtype, rows_k + (heads_kv, hdim_v)),
        out=fake_tensor(out_dtype, splits + rows_q + (heads, hdim_v)),
        lse=fake_tensor(Float32, splits + lse_shape, align=4), **_fake_scalars(),
        max_seqlen_q=Int32(1), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], seqused_q=used_q,
        seqused_k=used_k, **_fake_dropout(dropout), num_splits=Int32(1),
        blocks_per_split=Int32(0), page_table=table, k_new=new[0], v_new=new[1],
        append_dropped=new[2],
        **fake_aux(mods), **(_fake_merged(merged_dtype, rows_q, heads, hdim_v, lse_shape)
                             if merged else {}),
        timeline=(fake_tensor(Int64, (dynamic_dim(), dynamic_dim(), SLOTS, FIELDS), align=8)
                  if timeline else None),
        **(_fake_descales(descales) if descales else {}))


def _fake_descales(rank: int) -> dict:
    return {f"{x}_descale": fake_tensor(Float32, tuple(dynamic_dim() for _ in range(rank)),
                                        align=4) for x in "qkv"}


def _fake_merged(dtype, rows_q, heads, hdim_v, lse_shape) -> dict:
    return dict(merged_out=fake_tensor(dtype, rows_q + (heads, hdim_v)),
                merged_lse=fake_tensor(Float32, lse_shape, align=4),
                split_counts=fake_tensor(Int32, (dynamic_dim(),), align=4))


def fake_backward_args(dtype, hdim: int, hdim_v: int, varlen: bool, *, seqused=(False, False),
                       dkv_fp32: bool = False, stats_align: int = 4, dq_align: int = 4,
                       dq_accum_cols: Optional[int] = None,
                       semaphores: bool = False, dropout: bool = False,
                       mods=None, timeline: bool = False) -> BwdArgs:
    """A backward record of fake tensors, as `fake_forward_args`. The alignments are those the
    arch's launch promises (`launch_bwd.BackwardPlan`); `dq_accum_cols`: dQaccum as [.., h, cols]
    fragment-order tiles (`arch.hopper.dq_accum`) instead of laid out like q; `semaphores`:
    the deterministic backward's dQ semaphores; `mods`: a `KernelMods`, with its aux
    tensors."""
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
        seqused_k=used_k, dq_semaphores=sem, **_fake_dropout(dropout), **fake_aux(mods),
        timeline=(fake_tensor(Int64, (dynamic_dim(), dynamic_dim(), SLOTS, FIELDS), align=8)
                  if timeline else None))
