"""The FP8 forward as a torch.library operator, ``torch.ops.flash_cute.fwd_fp8``: what
torch.compile, fake tensors and CPU tensors see of `attention.flash_attn_fp8`. Its own
operator rather than trailing arguments of ``flash_cute::fwd``: the output dtype and the
scales change what the call is (a forward with no backward, its own validation), and the
16-bit operator's schema and autograd stay as they are. CUDA runs the Hopper kernel; CPU
the emulation; the fake implementation returns O in ``out_dtype`` and the LSE."""

import torch

from flash_cute.fp8 import attention

_LIB = torch.library.Library("flash_cute", "FRAGMENT")
_LIB.define("fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
            "Tensor? seqused_q, Tensor? seqused_k, Tensor q_descale, Tensor k_descale, "
            "Tensor v_descale, SymInt? max_seqlen_q, SymInt? max_seqlen_k, "
            "float? softmax_scale, bool causal, int? window_left, int? window_right, "
            "float softcap, bool? pack_gqa, int num_splits, Tensor? page_table, "
            "ScalarType out_dtype, str? arch) -> (Tensor out, Tensor lse)")


def _fwd_fp8(q, k, v, cu_q, cu_k, used_q, used_k, q_descale, k_descale, v_descale,
             max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
             softcap, pack_gqa, num_splits, page_table, out_dtype, arch):
    lengths = (cu_q, cu_k, used_q, used_k)
    problem = attention._problem(q, k, v, lengths, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, (window_left, window_right), softcap, pack_gqa,
                                 num_splits, page_table)
    scales = attention._scales((q_descale, k_descale, v_descale), problem, q.device)
    if q.is_cuda:
        return attention._cuda(q, k, v, problem, scales, out_dtype, lengths, page_table, arch)
    return attention._cpu(q, k, v, problem, scales, out_dtype, lengths, page_table)


_LIB.impl("fwd_fp8", _fwd_fp8, "CUDA")
_LIB.impl("fwd_fp8", _fwd_fp8, "CPU")


@torch.library.register_fake("flash_cute::fwd_fp8")
def _fwd_fp8_fake(q, k, v, cu_q, cu_k, used_q, used_k, q_descale, k_descale, v_descale,
                  max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                  softcap, pack_gqa, num_splits, page_table, out_dtype, arch):
    problem = attention._problem(q, k, v, (cu_q, cu_k, used_q, used_k), max_seqlen_q,
                                 max_seqlen_k, softmax_scale, causal,
                                 (window_left, window_right), softcap, pack_gqa, num_splits,
                                 page_table)
    attention._scales((q_descale, k_descale, v_descale), problem, q.device)
    out = q.new_empty((*q.shape[:-1], problem.hdim_v), dtype=out_dtype)
    lse_shape = ((problem.nheads, q.shape[0]) if cu_q is not None
                 else (q.shape[0], problem.nheads, q.shape[1]))
    return out, q.new_empty(lse_shape, dtype=torch.float32)
