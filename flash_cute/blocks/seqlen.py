"""Per-(batch) sequence bounds and tensor views, for padded and varlen (cu_seqlens) layouts.

Padded: Q [batch, seqlen, heads, d], LSE [batch, heads, seqlen]. Varlen: Q [total, heads, d] with
cu_seqlens [batch + 1], LSE [heads, total]. Either may add seqused [batch]: sequence b uses only
the first seqused[b] rows of its span. Kernels ask this block for a (seqlen, d) view of one
(batch, head) and its length, and never branch on the layout themselves.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_cute.blocks.dsl_state import DslState


class SeqInfo(DslState):
    """Offsets and lengths of batch `batch` for Q and K/V.

    `seqlen_q` / `seqlen_k` are the lengths a kernel works on: seqused[batch] when given (the
    rows after it are padding no kernel reads or writes), else the span's length.

    `extent_q` / `extent_k` (`extent`): the padded length, or varlen the rows of the packed
    tensor. Whatever cu_seqlens and seqused hold, every offset and length is clamped to them
    (bounds by construction): a span starts in [0, extent] and ends in [start, extent], a
    used length lies in [0, span]. Rows past a clamped end count as empty, so no index
    content makes a kernel touch memory outside its tensors; validation's content check
    (`FLASH_CUTE_CHECK_INPUTS=1`) turns such contents into errors instead. `max_seqlen_q`:
    a sequence's queries past it count as unused (the grid covers max_seqlen_q rows, rounded
    up to whole tiles; the backward's loops over query blocks follow the sequence).

    `pack` > 1 (packed GQA): Q, O and LSE come as `flash_cute.blocks.layouts.pack_heads` views,
    whose row mode holds `pack` rows per query; `rows_q` counts them. Lengths stay in queries.
    """

    def __init__(self, batch: Int32, extent_q, extent_k,
                 cu_seqlens_q: Optional[cute.Tensor] = None,
                 cu_seqlens_k: Optional[cute.Tensor] = None,
                 seqused_q: Optional[cute.Tensor] = None, seqused_k: Optional[cute.Tensor] = None,
                 pack: int = 1, max_seqlen_q=None):
        self.varlen = cu_seqlens_q is not None
        self.pack = pack
        self.offset_q, self.seqlen_q = _offset_and_length(batch, extent_q, cu_seqlens_q,
                                                          seqused_q)
        self.offset_k, self.seqlen_k = _offset_and_length(batch, extent_k, cu_seqlens_k,
                                                          seqused_k)
        if cutlass.const_expr(max_seqlen_q is not None and self.varlen):
            # Padded, max_seqlen_q is the extent already.
            self.seqlen_q = cutlass.min(self.seqlen_q, max_seqlen_q)
        self.batch = batch

    @staticmethod
    def extent(t: cute.Tensor, cu_seqlens: Optional[cute.Tensor] = None):
        """The row extent of Q/K-like `t` for `SeqInfo`: its packed rows (varlen) or its
        padded length."""
        if cutlass.const_expr(cu_seqlens is not None):
            return t.shape[0]
        return t.shape[1]

    @staticmethod
    def num_batches(mQ: cute.Tensor, cu_seqlens_q: Optional[cute.Tensor] = None):
        """Batch size of a launch: len(cu_seqlens) - 1 when varlen, else Q's leading extent."""
        if cutlass.const_expr(cu_seqlens_q is not None):
            return cu_seqlens_q.shape[0] - 1
        return mQ.shape[0]

    @property
    def rows_q(self):
        """Q rows of this sequence (seqlen_q, times `pack`)."""
        return self.seqlen_q * self.pack if cutlass.const_expr(self.pack > 1) else self.seqlen_q

    def q_view(self, mQ: cute.Tensor, head) -> cute.Tensor:
        """(rows_q, d) view of Q (or O, dO) for one head (packed: one group of heads)."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_q * self.pack, 0), mQ[None, head, None])
        return mQ[self.batch, None, head, None]

    def k_view(self, mK: cute.Tensor, head_kv) -> cute.Tensor:
        """(seqlen_k, d) view of K or V for one kv head."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_k, 0), mK[None, head_kv, None])
        return mK[self.batch, None, head_kv, None]

    def lse_view(self, mLSE: cute.Tensor, head) -> cute.Tensor:
        """(rows_q,) view of the LSE (or any per-query-row fp32 vector) for one head."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.offset_q * self.pack,), mLSE[head, None])
        return mLSE[self.batch, head, None]


def _offset_and_length(batch: Int32, extent, cu_seqlens: Optional[cute.Tensor],
                       seqused: Optional[cute.Tensor]):
    """(first row, used length) of one sequence of one side (Q or K/V), clamped to `extent`."""
    if cutlass.const_expr(cu_seqlens is not None):
        offset = cutlass.min(cutlass.max(cu_seqlens[batch], Int32(0)), extent)
        span = cutlass.min(cutlass.max(cu_seqlens[batch + 1], offset), extent) - offset
    else:
        offset, span = Int32(0), Int32(extent)
    if cutlass.const_expr(seqused is not None):
        return offset, cutlass.min(cutlass.max(seqused[batch], Int32(0)), span)
    return offset, span
