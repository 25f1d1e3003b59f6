"""Host-side launch plumbing shared by every pipeline's `api.py`: output allocation, the cases
that need no kernel, support checks, one compile-cached forward launch and one backward
sequence. A kernel class that declares `SUPPORTS_SEQUSED` takes (mSeqUsedQ, mSeqUsedK) right
after its cu_seqlens; the others' argument lists stay without them."""

import functools
from typing import Callable, NamedTuple

import torch

from flash_cute.variant import Variant

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


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


def forward(name: str, kernel_cls, q, k, v, problem, cu_seqlens_q, cu_seqlens_k, tile: tuple,
            options: str, arch: str, prepare=None, seqused_q=None, seqused_k=None,
            pack_gqa: int = 1):
    """Allocate, handle the no-work case, compile (cached) and launch one attention forward.

    `kernel_cls(dtype, hdim, hdim_v, variant, tile=...)` is the arch's kernel class; `prepare`
    adapts q/k/v first (e.g. TMA-ready strides). `seqused_q` / `seqused_k` (int32 [batch] or
    None) go to a kernel class with `SUPPORTS_SEQUSED` right after the cu_seqlens.
    `pack_gqa`: query heads per tile (`packed_heads`), for a kernel class that packs them.
    """
    from flash_cute.jit import (DTYPES, CompileKey, TensorArg, attention_runtime_args,
                                launch_kernel)

    out, lse = alloc_out_lse(q, problem)
    if has_no_work(q, k, problem):
        lse.fill_(-float("inf"))
        return out.zero_(), lse
    used = seqused_args(kernel_cls, problem, seqused_q, seqused_k)
    if prepare is not None:
        q, k, v = (prepare(t) for t in (q, k, v))
    variant = Variant.from_problem(problem, pack_gqa)
    dtype = dtype_name(q.dtype)
    key = CompileKey(name, arch, dtype, problem.hdim, problem.hdim_v, tile, variant.flags())
    scalars, cu = attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k)
    args = (TensorArg(q), TensorArg(k), TensorArg(v), TensorArg(out), TensorArg(lse, 4)) \
        + scalars + (int(problem.max_seqlen_q),) + cu + used
    launch_kernel(key, lambda: kernel_cls(DTYPES[dtype], problem.hdim, problem.hdim_v, variant,
                                          tile=tile), args, options)
    return out, lse


def backward(name: str, kernel_cls, dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q,
             cu_seqlens_k, tile: tuple, options: str, arch: str, prepare=None,
             deterministic=None, dq_accum_align: int = 4, row_stats_align: int = 4,
             seqused_q=None, seqused_k=None, dq_layout=None):
    """(dq, dk, dv) through a backward main kernel with `AmpereBwd.__call__`'s contract:
    preprocess (Δ, LSE·log2 e), the main kernel (compile-cached), dQ's scale-and-convert.

    `kernel_cls(dtype, hdim, hdim_v, variant, tile=...)`; `prepare` adapts q/k/v/dout first
    (e.g. TMA-ready strides). With GQA the kernel writes fp32 dK/dV per query head and the
    group is summed here, in a fixed order. Varlen dK/dV start at zero: rows after the last
    sequence get no gradient; so do they with seqused_k (keys past seqused_k[b]). dQ rows past
    seqused_q[b] get no atomics and stay 0 from dQaccum's zeros. `seqused_q` / `seqused_k`
    as in `forward`.

    `deterministic` is None for a kernel without that switch; a bool for one whose constructor
    takes `deterministic=` and whose call takes the dQ semaphores (`dq_semaphores`, or None)
    before the stream. `dq_accum_align`: the byte alignment the kernel may assume of dQaccum
    (a fresh allocation; 16 for a TMA). `row_stats_align`: the same for Δ and LSE·log2 e,
    whose rows (one per head) are then padded so every row starts that aligned (a TMA needs
    16-byte strides). `dq_layout`: None for dQaccum laid out like q (then `bwd_postprocess`),
    else an object whose `alloc(q, problem)` makes the kernel's own dQaccum (contiguous,
    uninitialized: the preprocess zeroes it) and whose
    `finish(dq_accum, q, problem, cu_seqlens_q)` returns dQ (e.g. the Hopper kernel's
    fragment-order tiles, `arch.hopper.dq_accum.TiledDqAccum`).
    """
    from flash_cute.bwd_prep import bwd_postprocess, bwd_preprocess
    from flash_cute.jit import TensorArg, attention_runtime_args, launch_kernel

    if has_no_work(q, k, problem):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    setup = _backward_setup(name, kernel_cls, problem, tile, arch, q.dtype, deterministic)
    used = seqused_args(kernel_cls, problem, seqused_q, seqused_k)
    delta, lse_log2 = row_stats_buffers(lse, row_stats_align)
    # Uninitialized: the preprocess zeroes it (no fill kernel of its own).
    dq_accum = (torch.empty(q.shape, dtype=torch.float32, device=q.device) if dq_layout is None
                else dq_layout.alloc(q, problem))
    bwd_preprocess(out, dout, lse, dlse, cu_seqlens_q, problem.max_seqlen_q, delta, lse_log2,
                   seqused_q=seqused_q, zero=dq_accum)
    if prepare is not None:
        q, k, v, dout = (prepare(t) for t in (q, k, v, dout))
    kv_lead = k.shape[:-2]
    dk = setup.alloc(*kv_lead, problem.nheads, problem.hdim, dtype=setup.dkv_dtype,
                     device=q.device)
    dv = setup.alloc(*kv_lead, problem.nheads, problem.hdim_v, dtype=setup.dkv_dtype,
                     device=q.device)
    _, cu = attention_runtime_args(problem, cu_seqlens_q, cu_seqlens_k)
    sem = ()
    if deterministic is not None:
        sem = (TensorArg(dq_semaphores(problem, tile[0], q.device), 4)
               if deterministic else None,)
    args = (TensorArg(q), TensorArg(k), TensorArg(v), TensorArg(dout),
            TensorArg(lse_log2, row_stats_align), TensorArg(delta, row_stats_align),
            TensorArg(dq_accum, dq_accum_align), TensorArg(dk, setup.dkv_align),
            TensorArg(dv, setup.dkv_align)) + setup.scalars + cu + used + sem
    launch_kernel(setup.key, setup.make_kernel, args, options)
    dq = (bwd_postprocess(dq_accum, problem.softmax_scale, q.dtype) if dq_layout is None
          else dq_layout.finish(dq_accum, q, problem, cu_seqlens_q))
    group = problem.qheads_per_kvhead
    if group > 1:
        dk = dk.view(*kv_lead, problem.nheads_kv, group, problem.hdim).sum(-2).to(q.dtype)
        dv = dv.view(*kv_lead, problem.nheads_kv, group, problem.hdim_v).sum(-2).to(q.dtype)
    return dq, dk, dv


class _BackwardSetup(NamedTuple):
    key: object
    make_kernel: Callable
    scalars: tuple
    dkv_dtype: torch.dtype
    dkv_align: int
    alloc: Callable


@functools.lru_cache(maxsize=256)
def _backward_setup(name, kernel_cls, problem, tile, arch, dtype, deterministic):
    """What `backward` works out from its configuration alone, once per configuration (a
    short backward's host time is on the GPU's critical path): the main kernel's compile key
    and factory, its scalar arguments (softmax scale, softcap, window, max_seqlen_k), and
    dK/dV's dtype (fp32 per query head for GQA, summed afterwards), alignment and
    allocation (zeroed where rows may get no gradient: varlen, seqused_k)."""
    from flash_cute.jit import DTYPES, attention_runtime_args

    group = problem.qheads_per_kvhead
    variant = Variant.from_problem(problem)
    dname = dtype_name(dtype)
    kernel_kw = {} if deterministic is None else {"deterministic": deterministic}
    scalars, _ = attention_runtime_args(problem, None, None)

    def make_kernel():
        return kernel_cls(DTYPES[dname], problem.hdim, problem.hdim_v, variant, tile=tile,
                          **kernel_kw)

    return _BackwardSetup(
        backward_compile_key(name, arch, dname, problem, tile, deterministic), make_kernel,
        scalars + (int(problem.max_seqlen_k),), torch.float32 if group > 1 else dtype,
        16 if group == 1 else 4,
        torch.zeros if problem.varlen or problem.has_seqused_k else torch.empty)


def seqused_args(kernel_cls, problem, seqused_q, seqused_k) -> tuple:
    """(mSeqUsedQ, mSeqUsedK) for a kernel class with `SUPPORTS_SEQUSED`, () for one without
    (whose argument list has no such slots): that one refuses a problem that needs them."""
    from flash_cute.jit import tensor_arg

    given = (seqused_q is not None, seqused_k is not None)
    if given != (problem.has_seqused_q, problem.has_seqused_k):
        raise ValueError(f"seqused_q/seqused_k given: {given}, but the problem was validated "
                         f"with {(problem.has_seqused_q, problem.has_seqused_k)}")
    if not getattr(kernel_cls, "SUPPORTS_SEQUSED", False):
        if any(given):
            raise NotImplementedError(f"{kernel_cls.__name__} does not take seqused_q/seqused_k")
        return ()
    return tuple(tensor_arg(t, 4) for t in (seqused_q, seqused_k))


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


def backward_compile_key(name: str, arch: str, dtype: str, problem, tile: tuple,
                         deterministic=None):
    """A backward main kernel's CompileKey: the variant, fp32 dK/dV for GQA and, for a kernel
    that has the switch, deterministic dQ."""
    from flash_cute.jit import CompileKey

    flags = Variant.from_problem(problem).flags() + (("dkv_fp32", problem.qheads_per_kvhead > 1),)
    if deterministic is not None:
        flags += (("deterministic", bool(deterministic)),)
    return CompileKey(name, arch, dtype, problem.hdim, problem.hdim_v, tuple(tile), flags)


def dq_semaphores(problem, tile_m: int, device) -> torch.Tensor:
    """Zeroed int32 [batch, nheads, ceil(max_seqlen_q / tile_m)]: per (query tile, head,
    batch), how many K/V tiles have added their dQ partial (deterministic backward)."""
    return torch.zeros(problem.batch, problem.nheads, -(-problem.max_seqlen_q // tile_m),
                       dtype=torch.int32, device=device)
