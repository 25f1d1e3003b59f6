"""A backward call's launch, worked out once per call configuration: what an arch's backward
needs of the shared sequence (`BackwardPlan`: preprocess, main kernel, dQ finish, GQA sum),
the fp32 scratch (dQaccum, Δ, LSE·log2 e from one allocation), the dQ accumulators' layouts
(`RowDqAccum`) and the deterministic semaphores (`BackwardLaunch`)."""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import torch

from flash_cute.contract.kernel_args import BwdArgs, dropout_scalars, score_scalars
from flash_cute.contract.variant import dtype_name
from flash_cute.runtime.launch import (
    CapturedTensors,
    SparseTiles,
    apply,
    check_seqused,
    has_no_work,
    restride,
    seed_spec,
    seed_words,
    variant_of,
)


class RowDqAccum(NamedTuple):
    """dQaccum laid out like q (fp32), added to by the main kernel (atomics) and turned into
    dQ by `bwd_prep.Postprocess`; the default `BackwardPlan.dq_accum`. `align`: what the
    kernel may assume of its address (a fresh allocation is 256-byte aligned; 4 promises only
    fp32)."""

    align: int = 4

    @staticmethod
    def shape(q, problem) -> tuple:
        return tuple(q.shape)

    @staticmethod
    def finisher(dq_accum, q, problem, cu_seqlens_q, target: str, out_dtype=None):
        """`finish(dq_accum, cu_seqlens_q) -> dq` for this configuration (`out_dtype`
        float32: the accumulator scaled, not rounded)."""
        from flash_cute.runtime.bwd_prep import Postprocess

        scale = float(problem.softmax_scale)
        if out_dtype == torch.float32:
            return lambda acc, cu: acc * scale
        post = Postprocess(dq_accum, q.dtype, target)
        return lambda acc, cu: post(acc, scale)


class BackwardPlan(NamedTuple):
    """What an arch's backward main kernel needs of `BackwardLaunch`: its compile-key name,
    kernel (`kernel_cls(dtype, hdim, hdim_v, variant, schedule=..., deterministic=...)`, a
    class or `KernelRef`, whose `__call__` takes a `kernel_args.BwdArgs`), schedule, compile
    options and target; `prepare` adapts q/k/v/dout first (e.g. TMA-ready strides);
    `dq_accum`: how dQaccum is laid out (`shape(q, problem)`, fp32, uninitialized: the
    preprocess zeroes it) and turned into dQ (`finisher(dq_accum, q, problem, cu_seqlens_q,
    target)`, a `finish(dq_accum, cu_seqlens_q) -> dq`), with the byte alignment the kernel may
    assume of it (`align`); `row_stats_align`: the same for Δ and LSE·log2 e, whose rows (one
    per head) are then padded so every row starts that aligned (a TMA needs 16-byte
    strides); `key_tiles_per_cta`: see below."""
    name: str
    kernel_cls: object
    schedule: tuple
    options: str
    target: str
    prepare: Optional[Callable] = None
    dq_accum: object = RowDqAccum()
    row_stats_align: int = 4
    # Key tiles a CTA's cluster walks at once (the blackwell pair: 2): a block mask's key
    # tiles come padded to a multiple of it, empty (`launch.SparseTiles`).
    key_tiles_per_cta: int = 1


class BackwardLaunch:
    """One attention backward's launches for a call configuration, worked out once (as
    `ForwardLaunch`): preprocess (Δ, LSE·log2 e; it also zeroes the uninitialized dQaccum),
    the main kernel of `plan`, then dQ from dQaccum (`plan.dq_accum`). Called with tensors of
    that configuration, it returns (dq, dk, dv).

    With GQA the kernel writes fp32 dK/dV per query head and the group is summed here, in a
    fixed order. Varlen dK/dV start at zero: rows after the last sequence get no gradient; so
    do they with seqused_k (keys past seqused_k[b]). dQ rows past seqused_q[b] get nothing
    added and stay 0 from dQaccum's zeros. `deterministic`: the kernel adds dQ in a fixed
    order, through zeroed per-query-tile semaphores (`dq_semaphores`).
    """

    def __init__(self, plan: BackwardPlan, dout, dlse, q, k, v, out, lse, problem,
                 cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None,
                 deterministic: bool = False, timeline=None):
        from flash_cute.runtime.bwd_prep import Preprocess
        from flash_cute.runtime.jit import KernelCall, TensorArg, tensor_arg

        check_seqused(problem, seqused_q, seqused_k)
        self.no_work = has_no_work(q, k, problem)
        self.aux = CapturedTensors(problem, q.device)
        # The measured timeline's record buffer (`python -m flash_cute profile --backward`).
        self.timeline = timeline
        self.grad_dtype = torch.float32 if problem.grads_fp32 else q.dtype
        if self.no_work:
            return
        deterministic = bool(deterministic)
        setup = _backward_setup(plan, problem, q.dtype, deterministic, timeline is not None)
        self.device, self.setup = q.device, setup
        self.scratch = _Scratch(plan.dq_accum.shape(q, problem), lse, plan.row_stats_align)
        dq_accum, delta, lse_log2 = self.scratch.alloc()
        self.max_seqlen_q = int(problem.max_seqlen_q)
        self.pre = Preprocess(out, dout, lse, dlse, cu_seqlens_q, seqused_q, dq_accum,
                              plan.target)
        self.restride = tuple(restride(t, plan.prepare) for t in (q, k, v, dout))
        kv_lead = tuple(k.shape[:-2])
        self.dk_shape = (*kv_lead, problem.nheads, problem.hdim)
        self.dv_shape = (*kv_lead, problem.nheads, problem.hdim_v)
        group = problem.qheads_per_kvhead
        self.group_shapes = None if group == 1 else (
            (*kv_lead, problem.nheads_kv, group, problem.hdim),
            (*kv_lead, problem.nheads_kv, group, problem.hdim_v))
        self.sem_shape = (problem.batch, problem.nheads,
                          -(-problem.max_seqlen_q // plan.schedule[0])) if deterministic else None
        dk, dv = self._alloc_dkv()
        sem = self._alloc_sem()
        varlen, align = problem.varlen, plan.row_stats_align
        drop = dropout_scalars(problem)
        self.dropout, self.dropout_scalars = problem.dropout_p > 0, tuple(drop.values())
        self.sparse = SparseTiles(problem, plan.schedule[:2], backward=True,
                                  key_tiles_per_cta=plan.key_tiles_per_cta)
        args = BwdArgs(q=TensorArg(q), k=TensorArg(k), v=TensorArg(v), dout=TensorArg(dout),
                       lse_log2=TensorArg(lse_log2, align), delta=TensorArg(delta, align),
                       dq_accum=TensorArg(dq_accum, plan.dq_accum.align),
                       dk=TensorArg(dk, setup.dkv_align), dv=TensorArg(dv, setup.dkv_align),
                       **setup.scalars,
                       cu_seqlens_q=tensor_arg(cu_seqlens_q, 4) if varlen else None,
                       cu_seqlens_k=tensor_arg(cu_seqlens_k, 4) if varlen else None,
                       seqused_q=tensor_arg(seqused_q, 4), seqused_k=tensor_arg(seqused_k, 4),
                       dq_semaphores=tensor_arg(sem, 4),
                       rng_seed=seed_spec(q.device, self.dropout), **drop,
                       **self.aux.fields(), **self.sparse.fields(),
                       timeline=None if timeline is None else TensorArg(timeline, 8))
        self.scalars = tuple(setup.scalars.values())
        self.main = KernelCall(setup.key, setup.make_kernel, args, plan.options)
        self.finish = plan.dq_accum.finisher(dq_accum, q, problem, cu_seqlens_q, plan.target,
                                             self.grad_dtype)

    def _alloc_dkv(self):
        s = self.setup
        return (s.alloc(self.dk_shape, dtype=s.dkv_dtype, device=self.device),
                s.alloc(self.dv_shape, dtype=s.dkv_dtype, device=self.device))

    def _alloc_sem(self):
        if self.sem_shape is None:
            return None
        return torch.zeros(self.sem_shape, dtype=torch.int32, device=self.device)

    def __call__(self, dout, dlse, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, rng_seed=None, mod_grads=None):
        """(dq, dk, dv); `mod_grads`, a list, receives the learnable captured tensors'
        gradients (`CapturedTensors.learned`)."""
        grads = self.aux.new_gradients()
        if self.no_work:
            if mod_grads is not None:
                mod_grads += self.aux.gradients(grads)
            # Contiguous, as the kernels' gradients are (the fake implementation says so).
            return tuple(t.new_zeros(t.shape, dtype=self.grad_dtype) for t in (q, k, v))
        dq_accum, delta, lse_log2 = self.scratch.alloc()
        self.pre(out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q,
                 self.max_seqlen_q, dq_accum)
        rq, rk, rv, rdo = self.restride
        dk, dv = self._alloc_dkv()
        self.main(apply(q, rq), apply(k, rk), apply(v, rv), apply(dout, rdo), lse_log2, delta,
                  dq_accum, dk, dv, *self.scalars, cu_seqlens_q, cu_seqlens_k, seqused_q,
                  seqused_k, self._alloc_sem(), seed_words(rng_seed, self.dropout),
                  *self.dropout_scalars, *self.aux.values(grads), *self.sparse.tensors,
                  *self.aux.scalar_values, self.timeline)
        if mod_grads is not None:
            mod_grads += self.aux.gradients(grads)
        dq = self.finish(dq_accum, cu_seqlens_q)
        if self.group_shapes is not None:
            dk = dk.view(self.group_shapes[0]).sum(-2).to(self.grad_dtype)
            dv = dv.view(self.group_shapes[1]).sum(-2).to(self.grad_dtype)
        return dq, dk, dv


def _contiguous_strides(shape) -> tuple:
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return tuple(strides)


class _Scratch:
    """The backward's fp32 scratch from one allocation (each is a few microseconds of host
    time): dQaccum (`accum_shape`, contiguous, first: 256-byte aligned), then Δ and
    LSE·log2 e, shaped like the LSE ([b, h, sq] or [h, total_q]), whose rows start
    `align`-byte aligned (the last dim is padded in memory, not in shape)."""

    def __init__(self, accum_shape: tuple, lse: torch.Tensor, align: int):
        n = lse.shape[-1]
        padded = -(-max(n, 1) // (align // 4)) * (align // 4)
        self.accum_shape = tuple(accum_shape)
        self.accum_strides = _contiguous_strides(self.accum_shape)
        accum = -(-math.prod(self.accum_shape) // 64) * 64
        stats_shape = (*lse.shape[:-1], padded)
        self.stats_shape = tuple(lse.shape)
        self.stats_strides = _contiguous_strides(stats_shape)
        stats = -(-math.prod(stats_shape) // 64) * 64
        self.offsets = (accum, accum + stats)
        self.numel = accum + 2 * stats
        self.device = lse.device

    def alloc(self) -> tuple:
        """(dq_accum, delta, lse_log2), uninitialized."""
        buf = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return (buf.as_strided(self.accum_shape, self.accum_strides, 0),
                buf.as_strided(self.stats_shape, self.stats_strides, self.offsets[0]),
                buf.as_strided(self.stats_shape, self.stats_strides, self.offsets[1]))


class _BackwardSetup(NamedTuple):
    key: object
    make_kernel: Callable
    scalars: dict
    dkv_dtype: torch.dtype
    dkv_align: int
    alloc: Callable


@functools.lru_cache(maxsize=256)
def _backward_setup(plan: BackwardPlan, problem, dtype, deterministic: bool,
                    timeline: bool = False):
    """What `BackwardLaunch` works out from its configuration alone: the main kernel's compile
    key and factory, its scalar fields (softmax scale, softcap, window, max_seqlen_k), and
    dK/dV's dtype (fp32 per query head for GQA, summed afterwards), alignment and
    allocation (zeroed where rows may get no gradient: varlen, seqused_k)."""
    from flash_cute.runtime.jit import DTYPES

    group = problem.qheads_per_kvhead
    wide = group > 1 or problem.grads_fp32   # dK/dV from the kernel in float32
    variant = dataclasses.replace(variant_of(problem), timeline=timeline)
    dname = dtype_name(dtype)

    def make_kernel():
        return plan.kernel_cls(DTYPES[dname], problem.hdim, problem.hdim_v, variant,
                               schedule=plan.schedule, deterministic=deterministic)

    key = backward_compile_key(plan.name, plan.target, dname, problem, plan.schedule,
                               deterministic)
    if timeline:
        key = dataclasses.replace(key, flags=key.flags + (("timeline", True),))
    return _BackwardSetup(
        key,
        make_kernel, {**score_scalars(problem), "max_seqlen_k": int(problem.max_seqlen_k),
                      "max_seqlen_q": int(problem.max_seqlen_q)},
        torch.float32 if wide else dtype, 16 if not wide else 4,
        torch.zeros if problem.varlen or problem.has_seqused_k else torch.empty)


def backward_compile_key(name: str, target: str, dtype: str, problem, schedule: tuple,
                         deterministic: bool = False):
    """A backward main kernel's CompileKey: the variant, fp32 dK/dV for GQA, deterministic dQ."""
    from flash_cute.runtime.jit import CompileKey

    flags = variant_of(problem).flags() + (
        ("dkv_fp32", problem.qheads_per_kvhead > 1 or getattr(problem, "grads_fp32", False)),
        ("deterministic", bool(deterministic)))
    return CompileKey(name, target, dtype, problem.hdim, problem.hdim_v, tuple(schedule), flags)


def dq_semaphores(problem, tile_m: int, device) -> torch.Tensor:
    """Zeroed int32 [batch, nheads, ceil(max_seqlen_q / tile_m)]: per (query tile, head,
    batch), how many K/V tiles have added their dQ partial (deterministic backward)."""
    return torch.zeros(problem.batch, problem.nheads, -(-problem.max_seqlen_q // tile_m),
                       dtype=torch.int32, device=device)
