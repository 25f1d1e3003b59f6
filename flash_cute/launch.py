"""Host-side launch plumbing shared by every pipeline's `api.py`: output allocation, the cases
that need no kernel, support checks, one compile-cached forward launch and one backward
sequence, each building its kernel's argument record (`flash_cute.kernel_args`)."""

import functools
from typing import Callable, NamedTuple, Optional

import torch

from flash_cute.kernel_args import BwdArgs, FwdArgs, score_scalars
from flash_cute.variant import Variant, dtype_name


def check_head_dims(pipeline: str, problem, supported) -> None:
    if (problem.hdim, problem.hdim_v) not in supported:
        pairs = ", ".join(f"{a}/{b}" for a, b in sorted(supported))
        raise NotImplementedError(
            f"the {pipeline} pipeline has no kernel for hdim/hdim_v {problem.hdim}/"
            f"{problem.hdim_v}; supported: {pairs}")


def check_shared_memory(pipeline: str, needed: int, device) -> None:
    """Refuse before launch when a kernel's tiles exceed what the GPU gives one CTA."""
    available = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    if needed > available:
        raise NotImplementedError(
            f"the {pipeline} kernel needs {needed} bytes of shared memory per CTA; "
            f"{torch.cuda.get_device_name(device)} allows {available}")


def alloc_out_lse(q: torch.Tensor, problem):
    """O (v's head dim) and LSE (fp32, [b, h, sq] or [h, total_q]).

    Varlen O is zeroed: rows after the last sequence belong to no sequence and are never
    written, but must not hold garbage for a caller that reduces over the whole tensor. With
    seqused_q the rows past seqused_q[b] are never written either: they get O = 0 and
    LSE = -inf here, the outputs of a row that sees no key.
    """
    alloc = torch.zeros if problem.varlen or problem.has_seqused_q else torch.empty
    out = alloc(*q.shape[:-1], problem.hdim_v, dtype=q.dtype, device=q.device)
    if problem.varlen:
        lse_shape = (problem.nheads, q.shape[0])
    else:
        lse_shape = (problem.batch, problem.nheads, q.shape[1])
    if problem.has_seqused_q:
        lse = torch.full(lse_shape, -float("inf"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, lse


def has_no_work(q, k, problem) -> bool:
    """No query row or no key at all: the outputs are O = 0, LSE = -inf, gradients 0, and a
    kernel grid (or a TMA descriptor) would have an empty extent."""
    return (q.numel() == 0 or k.numel() == 0 or problem.batch == 0
            or problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0)


def packed_heads(problem, tile_m: int, fill_rows=None) -> int:
    """How many query heads a forward tile of `tile_m` rows packs (packed GQA; 1: none).

    The heads of a group can share a tile only when their count divides `tile_m` (a tile
    then holds whole queries). ``pack_gqa=True`` requires that; None packs where packing
    fills tiles of `fill_rows` rows (default `tile_m`) clearly better: rows used / rows
    computed below 0.9x what packing gets, with max_seqlen_q queries (FlashAttention-3's rule
    without its varlen exception: it picks packing for decode and short prompts and leaves
    long sequences, varlen or not, alone).
    """
    group = problem.qheads_per_kvhead
    if problem.pack_gqa is False or group == 1:
        return 1
    if tile_m % group:
        if problem.pack_gqa:
            raise NotImplementedError(
                f"pack_gqa=True: {group} query heads per K/V head do not divide the tile's "
                f"{tile_m} rows; pass pack_gqa=None or False")
        return 1
    if problem.pack_gqa:
        return group
    fill_rows = fill_rows or tile_m

    def filled(rows):
        return rows / (-(-rows // fill_rows) * fill_rows)

    return group if filled(problem.max_seqlen_q) < 0.9 * filled(problem.max_seqlen_q * group) else 1


def forward(name: str, kernel_cls, q, k, v, problem, cu_seqlens_q, cu_seqlens_k, seqused_q,
            seqused_k, schedule: tuple, options: str, target: str, prepare=None,
            pack_gqa: int = 1):
    """Allocate, handle the no-work case, compile (cached) and launch one attention forward.

    `kernel_cls(dtype, hdim, hdim_v, variant, schedule=...)` is the arch's kernel class, whose
    `__call__` takes a `kernel_args.FwdArgs`; `prepare` adapts q/k/v first (e.g. TMA-ready
    strides). `seqused_q` / `seqused_k`: int32 [batch] or None, as `problem` was validated.
    `pack_gqa`: query heads per tile (`packed_heads`), for a kernel class that packs them.
    """
    from flash_cute.jit import DTYPES, CompileKey, TensorArg, launch_kernel, tensor_arg

    _check_seqused(problem, seqused_q, seqused_k)
    out, lse = alloc_out_lse(q, problem)
    if has_no_work(q, k, problem):
        lse.fill_(-float("inf"))
        return out.zero_(), lse
    if prepare is not None:
        q, k, v = (prepare(t) for t in (q, k, v))
    variant = Variant.from_problem(problem, pack_gqa)
    dtype = dtype_name(q.dtype)
    key = CompileKey(name, target, dtype, problem.hdim, problem.hdim_v, schedule,
                     variant.flags())
    varlen = problem.varlen
    args = FwdArgs(q=TensorArg(q), k=TensorArg(k), v=TensorArg(v), out=TensorArg(out),
                   lse=TensorArg(lse, 4), **score_scalars(problem),
                   max_seqlen_q=int(problem.max_seqlen_q),
                   cu_seqlens_q=tensor_arg(cu_seqlens_q, 4) if varlen else None,
                   cu_seqlens_k=tensor_arg(cu_seqlens_k, 4) if varlen else None,
                   seqused_q=tensor_arg(seqused_q, 4), seqused_k=tensor_arg(seqused_k, 4))
    launch_kernel(key, lambda: kernel_cls(DTYPES[dtype], problem.hdim, problem.hdim_v, variant,
                                          schedule=schedule), args, options)
    return out, lse


class RowDqAccum(NamedTuple):
    """dQaccum laid out like q (fp32), added to by the main kernel (atomics) and turned into
    dQ by `bwd_postprocess`; the default `BackwardPlan.dq_accum`. `align`: what the kernel may
    assume of its address (a fresh allocation is 256-byte aligned; 4 promises only fp32)."""

    align: int = 4

    @staticmethod
    def alloc(q, problem):
        # Uninitialized: the preprocess zeroes it (no fill kernel of its own).
        return torch.empty(q.shape, dtype=torch.float32, device=q.device)

    @staticmethod
    def finish(dq_accum, q, problem, cu_seqlens_q):
        from flash_cute.bwd_prep import bwd_postprocess

        return bwd_postprocess(dq_accum, problem.softmax_scale, q.dtype)


class BackwardPlan(NamedTuple):
    """What an arch's backward main kernel needs of `backward`: its compile-key name, kernel
    class (`kernel_cls(dtype, hdim, hdim_v, variant, schedule=..., deterministic=...)`, whose
    `__call__` takes a `kernel_args.BwdArgs`), schedule, compile options and target; `prepare`
    adapts q/k/v/dout first (e.g. TMA-ready strides); `dq_accum`: how dQaccum is laid out,
    allocated (`alloc(q, problem)`, uninitialized: the preprocess zeroes it) and turned into
    dQ (`finish(dq_accum, q, problem, cu_seqlens_q)`), with the byte alignment the kernel may
    assume of it (`align`); `row_stats_align`: the same for Δ and LSE·log2 e, whose rows (one
    per head) are then padded so every row starts that aligned (a TMA needs 16-byte
    strides)."""
    name: str
    kernel_cls: type
    schedule: tuple
    options: str
    target: str
    prepare: Optional[Callable] = None
    dq_accum: object = RowDqAccum()
    row_stats_align: int = 4


def backward(plan: BackwardPlan, dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q,
             cu_seqlens_k, seqused_q=None, seqused_k=None, deterministic: bool = False):
    """(dq, dk, dv): preprocess (Δ, LSE·log2 e; it also zeroes the uninitialized dQaccum), the
    main kernel of `plan` (compile-cached), then dQ from dQaccum (`plan.dq_accum.finish`).

    With GQA the kernel writes fp32 dK/dV per query head and the group is summed here, in a
    fixed order. Varlen dK/dV start at zero: rows after the last sequence get no gradient; so
    do they with seqused_k (keys past seqused_k[b]). dQ rows past seqused_q[b] get nothing
    added and stay 0 from dQaccum's zeros. `deterministic`: the kernel adds dQ in a fixed
    order, through zeroed per-query-tile semaphores (`dq_semaphores`).
    """
    from flash_cute.bwd_prep import bwd_preprocess
    from flash_cute.jit import TensorArg, launch_kernel, tensor_arg

    _check_seqused(problem, seqused_q, seqused_k)
    if has_no_work(q, k, problem):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    setup = _backward_setup(plan, problem, q.dtype, bool(deterministic))
    delta, lse_log2 = row_stats_buffers(lse, plan.row_stats_align)
    dq_accum = plan.dq_accum.alloc(q, problem)
    bwd_preprocess(out, dout, lse, dlse, cu_seqlens_q, problem.max_seqlen_q, delta, lse_log2,
                   seqused_q=seqused_q, zero=dq_accum)
    if plan.prepare is not None:
        q, k, v, dout = (plan.prepare(t) for t in (q, k, v, dout))
    kv_lead = k.shape[:-2]
    dk = setup.alloc(*kv_lead, problem.nheads, problem.hdim, dtype=setup.dkv_dtype,
                     device=q.device)
    dv = setup.alloc(*kv_lead, problem.nheads, problem.hdim_v, dtype=setup.dkv_dtype,
                     device=q.device)
    varlen, align = problem.varlen, plan.row_stats_align
    sem = dq_semaphores(problem, plan.schedule[0], q.device) if deterministic else None
    args = BwdArgs(q=TensorArg(q), k=TensorArg(k), v=TensorArg(v), dout=TensorArg(dout),
                   lse_log2=TensorArg(lse_log2, align), delta=TensorArg(delta, align),
                   dq_accum=TensorArg(dq_accum, plan.dq_accum.align),
                   dk=TensorArg(dk, setup.dkv_align), dv=TensorArg(dv, setup.dkv_align),
                   **setup.scalars,
                   cu_seqlens_q=tensor_arg(cu_seqlens_q, 4) if varlen else None,
                   cu_seqlens_k=tensor_arg(cu_seqlens_k, 4) if varlen else None,
                   seqused_q=tensor_arg(seqused_q, 4), seqused_k=tensor_arg(seqused_k, 4),
                   dq_semaphores=tensor_arg(sem, 4))
    launch_kernel(setup.key, setup.make_kernel, args, plan.options)
    dq = plan.dq_accum.finish(dq_accum, q, problem, cu_seqlens_q)
    group = problem.qheads_per_kvhead
    if group > 1:
        dk = dk.view(*kv_lead, problem.nheads_kv, group, problem.hdim).sum(-2).to(q.dtype)
        dv = dv.view(*kv_lead, problem.nheads_kv, group, problem.hdim_v).sum(-2).to(q.dtype)
    return dq, dk, dv


class _BackwardSetup(NamedTuple):
    key: object
    make_kernel: Callable
    scalars: dict
    dkv_dtype: torch.dtype
    dkv_align: int
    alloc: Callable


@functools.lru_cache(maxsize=256)
def _backward_setup(plan: BackwardPlan, problem, dtype, deterministic: bool):
    """What `backward` works out from its configuration alone, once per configuration (a
    short backward's host time is on the GPU's critical path): the main kernel's compile key
    and factory, its scalar fields (softmax scale, softcap, window, max_seqlen_k), and
    dK/dV's dtype (fp32 per query head for GQA, summed afterwards), alignment and
    allocation (zeroed where rows may get no gradient: varlen, seqused_k)."""
    from flash_cute.jit import DTYPES

    group = problem.qheads_per_kvhead
    variant = Variant.from_problem(problem)
    dname = dtype_name(dtype)

    def make_kernel():
        return plan.kernel_cls(DTYPES[dname], problem.hdim, problem.hdim_v, variant,
                               schedule=plan.schedule, deterministic=deterministic)

    return _BackwardSetup(
        backward_compile_key(plan.name, plan.target, dname, problem, plan.schedule, deterministic),
        make_kernel, {**score_scalars(problem), "max_seqlen_k": int(problem.max_seqlen_k)},
        torch.float32 if group > 1 else dtype, 16 if group == 1 else 4,
        torch.zeros if problem.varlen or problem.has_seqused_k else torch.empty)


def _check_seqused(problem, seqused_q, seqused_k) -> None:
    given = (seqused_q is not None, seqused_k is not None)
    if given != (problem.has_seqused_q, problem.has_seqused_k):
        raise ValueError(f"seqused_q/seqused_k given: {given}, but the problem was validated "
                         f"with {(problem.has_seqused_q, problem.has_seqused_k)}")


def row_stats_buffer(lse: torch.Tensor, align: int) -> torch.Tensor:
    """An uninitialized fp32 tensor shaped like `lse` ([b, h, sq] or [h, total_q]) whose rows
    start `align`-byte aligned: the last dim is padded in memory, not in shape."""
    return row_stats_buffers(lse, align, 1)[0]


def row_stats_buffers(lse: torch.Tensor, align: int, count: int = 2) -> tuple:
    """`count` such tensors (`row_stats_buffer`) from one allocation."""
    n = lse.shape[-1]
    padded = -(-max(n, 1) // (align // 4)) * (align // 4)
    buf = torch.empty(count, *lse.shape[:-1], padded, dtype=torch.float32, device=lse.device)
    return tuple(buf[i, ..., :n] for i in range(count))


def backward_compile_key(name: str, target: str, dtype: str, problem, schedule: tuple,
                         deterministic: bool = False):
    """A backward main kernel's CompileKey: the variant, fp32 dK/dV for GQA, deterministic dQ."""
    from flash_cute.jit import CompileKey

    flags = Variant.from_problem(problem).flags() + (
        ("dkv_fp32", problem.qheads_per_kvhead > 1), ("deterministic", bool(deterministic)))
    return CompileKey(name, target, dtype, problem.hdim, problem.hdim_v, tuple(schedule), flags)


def dq_semaphores(problem, tile_m: int, device) -> torch.Tensor:
    """Zeroed int32 [batch, nheads, ceil(max_seqlen_q / tile_m)]: per (query tile, head,
    batch), how many K/V tiles have added their dQ partial (deterministic backward)."""
    return torch.zeros(problem.batch, problem.nheads, -(-problem.max_seqlen_q // tile_m),
                       dtype=torch.int32, device=device)
