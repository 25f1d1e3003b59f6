"""Block: dropout on a thread's score fragment, with the keep rule of `flash_cute.reference.rng`.

Forward: after the online softmax has summed the unnormalized P of a block (the row sums
see every element), the dropped elements of P are zeroed before the PV GEMM, and O is scaled
by 1 / (1 - p) with 1 / l at the end. Backward: the same decisions, drawn again from the same
seed, zero dP and the P that dV reads (`flash_cute.blocks.bwd.p_and_ds`); dV is scaled by
1 / (1 - p) at the end and dS folds it in: dS = P ∘ (Z ∘ dP / (1 - p) − Δ).

A `Dropout` walks the fragment in Philox groups (one Philox4x32-10 block each) and hands
every element with its keep decision to a trace-time callback, so the forward and the
backward use one group walk. Two fragment orders are known (`rows_first`):

* True, the mma.sync / WGMMA accumulator (rows, cols) view: rows 2i, 2i+1 are queries q and
  q + 8, columns 4j..4j+3 are keys k, k+1, k+8, k+9: one group, eight elements.
  With `aligned` False (a thread's columns start 8, not 16, into a group) each 8-column
  atom draws its group alone and takes half of it.
* False, the same view of a transposed (Sᵀ = K Qᵀ) accumulator: rows 2i, 2i+1 are queries
  q, q+1 and columns 2j, 2j+1 keys k, k+8; rows i and i+2 (queries 8 apart) share a group
  with the two keys: four elements per group, the key's parity picking the 16-bit half.

The group's counter comes from its first element's coordinates; the kernels' tests compare
whole outputs against the reference's mask (`rng.keep_mask`), which checks the orders.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.constants import PHILOX_M, PHILOX_ROUNDS, PHILOX_W


@cute.jit
def _mulhilo(a: Uint32, m: int):
    wide = cute.arch.mul_wide(a, Uint32(m))
    return (wide >> Uint64(32)).to(Uint32), wide.to(Uint32)


@cute.jit
def philox(c0: Uint32, c1: Uint32, c2: Uint32, c3: Uint32, k0: Uint32, k1: Uint32):
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1): four Uint32."""
    for r in cutlass.range_constexpr(PHILOX_ROUNDS):
        if cutlass.const_expr(r > 0):
            k0, k1 = k0 + Uint32(PHILOX_W[0]), k1 + Uint32(PHILOX_W[1])
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


class Dropout(DslState):
    """One thread's dropout for one (batch entry, query head): `seed` the int32 [2] key words,
    `threshold` keep_threshold(p) << 16 (an Int32 run-time value), `batch_head` b · nheads + h.
    `scale` 1 / (1 - p) is kept for the caller (O's, dV's and dS's factor)."""

    def __init__(self, seed: cute.Tensor, threshold: Int32, scale, batch_head: Int32,
                 tile_m: int, tile_n: int, rows_first: bool = True, aligned: bool = True):
        self.k0, self.k1 = Uint32(seed[0]), Uint32(seed[1])
        self.threshold, self.scale = Uint32(threshold), scale
        self.batch_head = Uint32(batch_head)
        self.tile_m, self.tile_n, self.rows_first = tile_m, tile_n, rows_first
        # False: a thread's key columns start at a multiple of 8 but not of 16 (a warpgroup
        # holding 24 of 48 keys), so its 8-column atoms do not pair up into groups.
        self.aligned = aligned

    @cute.jit
    def _words(self, q: Int32, k: Int32):
        return philox(Uint32(k), Uint32(q), self.batch_head, Uint32(0), self.k0, self.k1)

    @cute.jit
    def for_each(self, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32, visit):
        """visit(r, c, keep) for every element (r, c) of the thread's (rows, cols) fragment of
        score tile (m_block, n_block), `coord_mn` its tile coordinates (query, key)."""
        rows, cols = cute.size(coord_mn, mode=[0]), cute.size(coord_mn, mode=[1])
        q0, k0 = m_block * self.tile_m, n_block * self.tile_n
        if cutlass.const_expr(self.rows_first and not self.aligned):
            # One group per 8-column atom, half of it used: which half of the group's words
            # the atom takes is the key's bit 3, known at run time.
            for i in cutlass.range_constexpr(rows // 2):
                for a in cutlass.range_constexpr(cols // 2):
                    crd = coord_mn[2 * i, 2 * a]
                    k = k0 + crd[1]
                    w = self._words(q0 + crd[0], k & Int32(~9))
                    upper = (k & Int32(8)) != Int32(0)
                    for e in cutlass.range_constexpr(4):
                        qh, kl = e // 2, e % 2
                        word = Uint32(cutlass.select_(upper, w[2 * qh + 1], w[2 * qh]))
                        bits = word if cutlass.const_expr(kl == 1) else word << Uint32(16)
                        visit(2 * i + qh, 2 * a + kl, bits < self.threshold)
        elif cutlass.const_expr(self.rows_first):
            for i in cutlass.range_constexpr(rows // 2):
                for j in cutlass.range_constexpr(cols // 4):
                    crd = coord_mn[2 * i, 4 * j]
                    w = self._words(q0 + crd[0], k0 + crd[1])
                    for e in cutlass.range_constexpr(8):
                        qh, kh, kl = e // 4, (e // 2) % 2, e % 2
                        word = w[2 * qh + kh]
                        bits = word if cutlass.const_expr(kl == 1) else word << Uint32(16)
                        visit(2 * i + qh, 4 * j + 2 * kh + kl, bits < self.threshold)
        else:
            # Keys k and k+8 in columns 2j, 2j+1; queries q, q+1 in rows 4g + ql, q+8 two
            # rows down.
            for g in cutlass.range_constexpr(rows // 4):
                for ql in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(cols // 2):
                        crd = coord_mn[4 * g + ql, 2 * j]
                        k = k0 + crd[1]
                        w = self._words(q0 + crd[0], k & Int32(~1))
                        shift = Uint32(16) - Uint32(16) * Uint32(k & Int32(1))
                        for e in cutlass.range_constexpr(4):
                            qh, kh = e // 2, e % 2
                            visit(4 * g + 2 * qh + ql, 2 * j + kh,
                                  (w[2 * qh + kh] << shift) < self.threshold)

    @cute.jit
    def drop(self, p_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32):
        """In place: dropped entries of P become 0 (the forward, after the row sums)."""
        def visit(r, c, keep):
            p_mn[r, c] = kept(keep, p_mn[r, c])
        self.for_each(coord_mn, m_block, n_block, visit)


def kept(keep, value: Float32) -> Float32:
    """`value` where `keep`, else 0 (one FSEL; callbacks run at trace time, where a Python
    conditional on a DSL value would not be staged)."""
    return Float32(cutlass.select_(keep, value, Float32(0.0)))
