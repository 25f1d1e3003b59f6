"""Per-(batch) sequence bounds and tensor views, for padded and varlen (cu_seqlens) layouts.

Padded: Q [batch, seqlen, heads, d], LSE [batch, heads, seqlen]. Varlen: Q [total, heads, d] with
cu_seqlens [batch + 1], LSE [heads, total]. Kernels ask this block for a (seqlen, d) view of one
(batch, head) and never branch on the layout themselves.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_cute.dsl_state import DslState


class SeqInfo(DslState):
    """Offsets and lengths of batch `batch` for Q and K/V."""

    def __init__(self, batch: Int32, seqlen_q_static, seqlen_k_static,
                 cu_seqlens_q: Optional[cute.Tensor] = None, cu_seqlens_k: Optional[cute.Tensor] = None):
        self.varlen = cu_seqlens_q is not None
        if cutlass.const_expr(self.varlen):
            self.offset_q = cu_seqlens_q[batch]
            self.seqlen_q = cu_seqlens_q[batch + 1] - self.offset_q
            self.offset_k = cu_seqlens_k[batch]
            self.seqlen_k = cu_seqlens_k[batch + 1] - self.offset_k
        else:
            self.offset_q = Int32(0)
            self.offset_k = Int32(0)
            self.seqlen_q = Int32(seqlen_q_static)
            self.seqlen_k = Int32(seqlen_k_static)
        self.batch = batch

    @staticmethod
    def num_batches(mQ: cute.Tensor, cu_seqlens_q: Optional[cute.Tensor] = None):
        """Batch size of a launch: len(cu_seqlens) - 1 when varlen, else Q's leading extent."""
        if cutlass.const_expr(cu_seqlens_q is not None):
            return cu_seqlens_q.shape[0] - 1
        return mQ.shape[0]

    def q_view(self, mQ: cute.Tensor, head) -> cute.Tensor:
        """(seqlen_q, d) view of Q (or O, dO) for one head."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_q, 0), mQ[None, head, None])
        return mQ[self.batch, None, head, None]

    def k_view(self, mK: cute.Tensor, head_kv) -> cute.Tensor:
        """(seqlen_k, d) view of K or V for one kv head."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_k, 0), mK[None, head_kv, None])
        return mK[self.batch, None, head_kv, None]

    def lse_view(self, mLSE: cute.Tensor, head) -> cute.Tensor:
        """(seqlen_q,) view of the LSE (or any per-query-row fp32 vector) for one head."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_q,), mLSE[head, None])
        return mLSE[self.batch, head, None]
