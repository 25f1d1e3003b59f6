"""A call's one validation pass: the `AttentionProblem` of an operator call (`validate_call`),
with everything about it that can be refused before any launch: its paged cache read as the
K and V it stands for, its dropout seed, its mods (`with_mods`), a gradient it cannot have,
its append (`forward_problem`); for a backward, its gradients' tensors (`backward_problem`).
`flash_cute.runtime.plans` runs it once per call configuration, then dispatches and plans."""

import dataclasses

import torch

from flash_cute.contract.constants import DROPOUT_FRAME, DROPOUT_SHIFT, dropout_frame_kind
from flash_cute.runtime import paging
from flash_cute.runtime.problem import validate_attention_inputs, validate_backward_inputs
from flash_cute.variants import derivative, kernel_view, registry


def forward_problem(q, k, v, lengths: tuple, options: tuple, rng_seed, splits,
                    page_table=None, append=None, partial: bool = False):
    """The problem of a `flash_cute::fwd` call on CUDA tensors, all its checks passed
    (`partial`: the operator's partial_out)."""
    needs_grad = options[10]
    problem = validate_call(q, k, v, lengths, options, dropout=(options[12], rng_seed),
                            splits=splits, page_table=page_table)
    problem = with_mods(problem, options[11], q)
    if partial:
        if needs_grad or append is not None:
            raise ValueError("partial_out is a ring step's forward: no gradient, no append")
        problem = dataclasses.replace(problem, partial_out=True)
    if page_table is not None and needs_grad:
        raise NotImplementedError("no backward through a page_table: call flash_attn_func / "
                                  "flash_attn_varlen_func, which gather the pages when "
                                  "gradients are needed")
    if needs_grad and problem.mods is not None and derivative.learnable(problem.mods):
        kernel_view.kernel_mods(problem.mods, True)   # what their gradients cannot be
    if append is not None:
        check_append(k, v, lengths, append, problem)
    return problem


def backward_problem(dout, q, k, v, out, lse, lengths: tuple, options: tuple, rng_seed,
                     mod_grads: bool, grads_fp32: bool = False):
    """The problem of a `flash_cute::bwd` call on CUDA tensors, all its checks passed
    (`grads_fp32`: the operator's float32 dQ, dK, dV)."""
    deterministic = options[8]
    problem = validate_call(q, k, v, lengths, options, dropout=(options[11], rng_seed))
    problem = with_mods(problem, options[10], q, mod_grads)
    if grads_fp32:
        problem = dataclasses.replace(problem, grads_fp32=True)
    if deterministic and problem.mods is not None and problem.mods.block_states is not None:
        raise NotImplementedError("deterministic=True with a block_mask: the fixed dQ "
                                  "order assumes every key tile of the mask's range")
    validate_backward_inputs(dout, q, k, v, out, lse, problem)
    return problem


def validate_call(q, k, v, lengths: tuple, options: tuple, require_cuda: bool = True,
                  dropout=(0.0, None), splits=(1, None), page_table=None):
    """The `AttentionProblem` of an operator call (`options`: max_seqlen_q, max_seqlen_k,
    softmax_scale, causal, window_left, window_right, softcap, pack_gqa, ...; `dropout`:
    (dropout_p, rng_seed); `splits`: (num_splits, seqlen_k_per_split); `page_table`: k and v
    are paged caches, validated as the K and V they stand for, `paging.logical`)."""
    cu_q, cu_k, used_q, used_k = lengths
    if page_table is not None:
        k, v, cu_k = paged_view(q, k, v, lengths, page_table, require_cuda)
        require_cuda = False   # checked on the real tensors just now
    max_q, max_k, scale, causal, left, right, softcap, pack_gqa = options[:8]
    problem = validate_attention_inputs(
        q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right),
        softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
        seqused_k=used_k, max_seqlen_q=max_q, max_seqlen_k=max_k, pack_gqa=pack_gqa,
        dropout_p=dropout[0], num_splits=splits[0], seqlen_k_per_split=splits[1],
        require_cuda=require_cuda)
    if problem.dropout_p > 0:
        check_seed(dropout[1], q)
        kind = dropout_frame_kind(dropout[1].numel())
        if kind:
            problem = dataclasses.replace(problem, dropout_frame=kind)
    return problem


def paged_view(q, k, v, lengths, page_table, require_cuda: bool):
    """The logical K, V and cu_seqlens_k of a paged call, after the checks of its real
    tensors."""
    from flash_cute.runtime.checks import check_devices, check_memory_layout

    cu_q, cu_k, used_q, used_k = lengths
    if cu_k is not None:
        raise ValueError("page_table describes each sequence's keys by its pages: pass "
                         "seqused_k for their lengths, not cu_seqlens_k")
    batch = q.shape[0] if cu_q is None else cu_q.shape[0] - 1
    paging.check_paged(k, v, page_table, batch)
    if require_cuda:
        check_devices(q=q, k=k, v=v, page_table=page_table, cu_seqlens_q=cu_q,
                       seqused_q=used_q, seqused_k=used_k)
    for name, t in (("k", k), ("v", v)):
        check_memory_layout(name, t)
    return paging.logical(k, v, page_table, cu_q is not None)


def check_seed(rng_seed, q) -> None:
    """A seed is int64 [1] (`rng.draw_seed`), or longer with a frame (`rng.framed_seed`, its
    two forms told apart by length; a frame moves only the draws' coordinates, never an
    address, so its values are not read here: that would wait for the device)."""
    if not (isinstance(rng_seed, torch.Tensor) and rng_seed.dtype == torch.int64
            and rng_seed.dim() == 1 and dropout_frame_kind(rng_seed.numel()) is not None
            and rng_seed.device == q.device and rng_seed.is_contiguous()):
        got = (f"{rng_seed.dtype} {tuple(rng_seed.shape)} on {rng_seed.device}"
               if isinstance(rng_seed, torch.Tensor) else type(rng_seed).__name__)
        raise ValueError(f"dropout_p > 0 needs rng_seed, an int64 [1] tensor on q's device "
                         f"({q.device}; `flash_cute.reference.rng.draw_seed`), or int64 "
                         f"[{1 + len(DROPOUT_SHIFT)}] or [{1 + len(DROPOUT_FRAME)}] with a "
                         f"frame (`rng.framed_seed`), got {got}")


def with_mods(problem, key: int, q, grads: bool = False):
    """`problem` with the call's mods (registry `key`; 0: none), after the kernels' checks:
    what their graphs may use (`kernel_view.kernel_mods`) and where their tensors live;
    `grads`: a backward that also gives the learnable captured tensors' gradients."""
    if not key:
        return problem
    variant = registry.lookup(key)
    grads = grads and bool(derivative.learnable(variant))
    aux = kernel_view.kernel_mods(variant, grads)[1]
    for t in aux:
        if t.device != q.device:
            raise ValueError(f"a score_mod / mask_mod captures a tensor on {t.device}; the "
                             f"kernels read it on q's device ({q.device}): move it there")
    return dataclasses.replace(problem, mods=variant, mods_key=key, mod_grads=grads)


def check_append(k, v, lengths, append, problem) -> None:
    if problem.varlen or lengths[3] is None:
        raise ValueError("an append runs on a padded (or paged) cache with seqused_k, not "
                         "with cu_seqlens")
    paging.check_append(k, v, *append, problem.batch, lengths[3])
