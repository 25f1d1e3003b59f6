"""conftest.py for running flash_attn.cute's own tests on flash-cute (copied next to them by
`bench/fa4_tests.sh`): the functions of `flash_attn.cute.interface` that FA4's tests call
become flash-cute's before the test module imports them, so the tests call flash-cute exactly
as they call FA4; FA4's helpers (`flash_attn.cute.testing`: its reference, padding masks and
fake-tensor mode) stay FA4's.

Besides the public functions, the score/mask-mod tests call FA4's internal entry points
`_flash_attn_fwd` (q, k, v -> out, lse, ...; into `out` / `lse` when given) and
`_flash_attn_bwd` (q, k, v, out, dout, lse -> dq, dk, dv): here they run flash-cute's forward
and its backward operator with the same mods. Their tuning arguments (tile sizes, thread
counts, swaps, `_arch`) are FA4's own and ignored; features flash-cute lacks raise
NotImplementedError from flash-cute, naming them. FA4's block-sparsity tensors become a
block mask (`flash_cute.variants.block_mask.from_fa4`; the backward's are key-major)."""

import flash_attn.cute.interface as fa4
import torch

import flash_cute
from flash_cute.api import interface as fc

for _name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine"):
    setattr(fa4, _name, getattr(flash_cute, _name))


def _window(left, right):
    return (None if left is None or left < 0 else left,
            None if right is None or right < 0 else right)


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                    seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                    page_table=None, softmax_scale=None, causal=False, softcap=None,
                    window_size_left=None, window_size_right=None, learnable_sink=None,
                    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                    num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                    block_sparse_tensors=None, return_lse=False, out=None, lse=None,
                    aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
                    v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
                    seqlen_k_per_split=None, disable_scheduler_metadata=False):
    common = dict(softmax_scale=softmax_scale, causal=causal,
                  window_size=_window(window_size_left, window_size_right),
                  learnable_sink=learnable_sink, softcap=softcap or 0.0, num_splits=num_splits,
                  pack_gqa=pack_gqa, score_mod=score_mod, mask_mod=mask_mod,
                  aux_tensors=aux_tensors, aux_scalars=aux_scalars, qv=qv,
                  block_sparse_tensors=block_sparse_tensors, return_lse=True)
    with torch.no_grad():
        if (cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None
                and seqused_k is None):
            o, l = flash_cute.flash_attn_func(q, k, v, page_table=page_table, **common)
        else:
            o, l = flash_cute.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, **common)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return o, l if (return_lse or lse is not None) else None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                    window_size_left=None, window_size_right=None, m_block_size=64,
                    n_block_size=128, num_threads=256, pack_gqa=False, num_stages_Q=2,
                    num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                    AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False,
                    cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None,
                    dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, dlse=None, learnable_sink=None):
    if learnable_sink is not None:
        raise NotImplementedError("learnable_sink through FA4's _flash_attn_bwd (flash-cute "
                                  "folds the sink outside the kernels; its autograd gives dsink)")
    block_mask = None
    if block_sparse_tensors is not None:
        # FA4's backward tensors list query blocks by key block: the same mask, transposed.
        from flash_cute.variants.block_mask import from_fa4

        block_mask = from_fa4(block_sparse_tensors, q.shape[1], k.shape[1], key_major=True)
    variant = 0
    if (score_mod is not None or mask_mod is not None or aux_tensors is not None
            or aux_scalars is not None or block_mask is not None):
        variant = fc._variant_key(score_mod, mask_mod, softcap or 0.0, block_mask, None,
                                  q.shape[0], q.shape[-2], score_mod_bwd, aux_tensors,
                                  aux_scalars)
    options = fc._options(max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          _window(window_size_left, window_size_right), softcap or 0.0,
                          None, deterministic, None)
    grads = torch.ops.flash_cute.bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                     seqused_q, seqused_k, *options, variant)
    for given, g in zip((dq, dk, dv), grads):
        if given is not None:
            given.copy_(g)
    return tuple(g if given is None else given for given, g in zip((dq, dk, dv), grads))


fa4._flash_attn_fwd = _flash_attn_fwd
fa4._flash_attn_bwd = _flash_attn_bwd
