"""Masking of a score tile: sequence bounds, causal and local (sliding-window) attention.

Convention (flash-attn's): masks are aligned bottom-right, so with ``off = seqlen_k - seqlen_q``
key j is visible to query i iff ``i + off - left <= j <= i + off + right`` and ``j < seqlen_k``.
Causal is the window (left=None, right=0); None means unbounded on that side.

The block works on any arch's accumulator through two views that the arch builds the same way:
``acc_mn`` (a thread's scores as rows x cols) and ``coord_mn`` (the (row, col) coordinate of each
of those elements inside the tile, from an identity tensor partitioned like the accumulator).
Which tiles need a mask at all comes from `block_range`; this block only does the per-element
work, which every kernel reaches through the score seam (`flash_cute.blocks.score.Scores`). Model:
`flash_cute.reference.attention.attention_mask`. With packed GQA (``pack`` > 1) tile row r is query
``(m_block * tile_m + r) // pack`` (see `flash_cute.contract.block_range`).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.block_range import BlockRange, block_range


class AttentionMask(DslState):
    """Writes -inf into the masked entries of a score tile.

    `causal`, and whether each window side exists, are compile-time; the window sizes and
    sequence lengths are run-time values, so a new length or window never recompiles.
    """

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        seqlen_q: Int32,
        seqlen_k: Int32,
        causal: bool = False,
        window_left: Optional[Int32] = None,
        window_right: Optional[Int32] = None,
        pack: int = 1,
    ):
        self.tile_m = tile_m
        self.pack = pack
        self.tile_n = tile_n
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.causal = causal
        self.window_left = window_left
        self.window_right = Int32(0) if causal else window_right

    @property
    def has_right(self) -> bool:
        return self.causal or self.window_right is not None

    @property
    def has_left(self) -> bool:
        return self.window_left is not None

    def block_range(self, m_block: Int32) -> BlockRange:
        """The K/V blocks query block `m_block` visits, and which of them need this mask."""
        return block_range(m_block, self.tile_m, self.tile_n, self.seqlen_q, self.seqlen_k,
                           self.causal, self.window_left, self.window_right, self.pack,
                           imin=cutlass.min, imax=cutlass.max)

    @cute.jit
    def apply(
        self,
        acc_mn: cute.Tensor,
        coord_mn: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool] = True,
        mask_window: cutlass.Constexpr[bool] = True,
    ):
        """Mask one tile. `mask_seqlen`/`mask_window` are off for tiles that cannot need them."""
        # Limits are taken relative to this thread's first column, so that each element's test
        # is against a compile-time constant offset, not a column index held in a register.
        col_base = coord_mn[0, 0][1]
        n_offset = n_block * self.tile_n + col_base
        seqlen_k_limit = self.seqlen_k - n_offset
        diag = self.seqlen_k - self.seqlen_q - n_offset
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = m_block * self.tile_m + coord_mn[r, 0][0]
            if cutlass.const_expr(self.pack > 1):
                row = row // self.pack
            # Visible iff left_lim <= col - col_base < right_lim.
            right_lim = seqlen_k_limit
            if cutlass.const_expr(mask_window and self.has_right):
                right_lim = cutlass.min(right_lim, row + diag + self.window_right + 1)
            if cutlass.const_expr(not mask_seqlen and not (mask_window and self.has_right)):
                right_lim = Int32(self.tile_n)
            left_lim = Int32(0)
            if cutlass.const_expr(mask_window and self.has_left):
                left_lim = row + diag - self.window_left
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                col = coord_mn[0, c][1] - col_base
                # A select, not an `if`: a run-time `if` would carry the whole fragment.
                masked = col >= right_lim
                if cutlass.const_expr(mask_window and self.has_left):
                    masked = masked | (col < left_lim)
                acc_mn[r, c] = -Float32.inf if masked else acc_mn[r, c]
