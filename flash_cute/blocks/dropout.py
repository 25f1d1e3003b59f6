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

A framed seed (`rng.framed_seed`) moves the coordinates into a larger attention. A shift by
multiples of 16 keeps every group whole: the walk runs as it is, from shifted tile corners.
Any other frame (a stride, as a striped ring step has) scatters the groups, so each element
draws its own block, one at a time, into a register bit array that the visits then read.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.constants import (
    DROPOUT_FRAME,
    DROPOUT_SHIFT,
    PHILOX_M,
    PHILOX_ROUNDS,
    PHILOX_W,
)


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
    """One thread's dropout for one (batch entry, query head): `seed` the int32 view of the
    call's seed (`rng.draw_seed`, or `rng.framed_seed` with `framed`), `threshold`
    keep_threshold(p) << 16 (an Int32 run-time value), `stream` (b, h, the call's heads).
    `scale` 1 / (1 - p) is kept for the caller (O's, dV's and dS's factor)."""

    def __init__(self, seed: cute.Tensor, threshold: Int32, scale, stream: tuple,
                 tile_m: int, tile_n: int, rows_first: bool = True, aligned: bool = True,
                 framed: str = ""):
        batch, head, nheads = stream
        self.k0, self.k1 = Uint32(seed[0]), Uint32(seed[1])
        self.threshold, self.scale = Uint32(threshold), scale
        self.tile_m, self.tile_n, self.rows_first = tile_m, tile_n, rows_first
        # False: a thread's key columns start at a multiple of 8 but not of 16 (a warpgroup
        # holding 24 of 48 keys), so its 8-column atoms do not pair up into groups.
        self.aligned = aligned
        # The seed's frame ("shift", "frame"; "" none: `contract.constants`).
        self.framed = framed
        if framed:
            fields = DROPOUT_SHIFT if framed == "shift" else DROPOUT_FRAME
            # The int64 fields' low words.
            field = {name: Int32(seed[2 + 2 * i]) for i, name in enumerate(fields)}
            self.batch_head = Uint32((batch + field["batch_offset"]) * field["heads"]
                                     + field["head_offset"] + head)
            if framed == "shift":
                self.q_first = Int32(16) * field["q_first_16"]
                self.k_first = Int32(16) * field["k_first_16"]
            else:
                self.q_first, self.k_first = field["q_first"], field["k_first"]
                self.stride = field["stride"]
        else:
            self.batch_head = Uint32(batch * nheads + head)

    @cute.jit
    def _words(self, q: Int32, k: Int32):
        return philox(Uint32(k), Uint32(q), self.batch_head, Uint32(0), self.k0, self.k1)

    @cute.jit
    def for_each(self, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32, visit):
        """visit(r, c, keep) for every element (r, c) of the thread's (rows, cols) fragment of
        score tile (m_block, n_block), `coord_mn` its tile coordinates (query, key)."""
        q0, k0 = m_block * self.tile_m, n_block * self.tile_n
        if cutlass.const_expr(self.framed != "frame"):
            if cutlass.const_expr(self.framed == "shift"):
                q0, k0 = q0 + self.q_first, k0 + self.k_first
            self._walk(coord_mn, q0, k0, visit)
        else:
            # The decisions first, as bits, then the caller's visit over constant indices.
            keeps = self._framed_keeps(coord_mn, q0, k0)
            cols = cute.size(coord_mn, mode=[1])
            for r in cutlass.range_constexpr(cute.size(coord_mn, mode=[0])):
                for c in cutlass.range_constexpr(cols):
                    i = r * cols + c
                    bit = (keeps[i // 32] >> Uint32(i % 32)) & Uint32(1)
                    visit(r, c, bit != Uint32(0))

    @cute.jit
    def _framed_keeps(self, coord_mn: cute.Tensor, q0: Int32, k0: Int32) -> cute.Tensor:
        """Any frame's decisions for the fragment, bit r · cols + c of a register array: the
        frame's positions (a stride, or starts off the groups) scatter the groups, so each
        element draws its own Philox block, one element at a time (unrolled over the
        fragment, the blocks would run out of registers beside the accumulators)."""
        rows, cols = cute.size(coord_mn, mode=[0]), cute.size(coord_mn, mode=[1])
        words = (rows * cols + 31) // 32
        keeps = cute.make_rmem_tensor(words, Uint32)
        for w in cutlass.range_constexpr(words):
            keeps[w] = Uint32(0)
        for i in cutlass.range(rows * cols, unroll=1):
            crd = coord_mn[i // cols, i % cols]
            keep = self._keep_at(self.q_first + self.stride * (q0 + crd[0]),
                                 self.k_first + self.stride * (k0 + crd[1]))
            bit = Uint32(cutlass.select_(keep, Uint32(1), Uint32(0))) << Uint32(i % 32)
            # Every word by a constant index, so the array stays in registers.
            for w in cutlass.range_constexpr(words):
                keeps[w] = keeps[w] | Uint32(cutlass.select_(i // 32 == w, bit, Uint32(0)))
        return keeps

    @cute.jit
    def _keep_at(self, qg: Int32, kg: Int32):
        """The decision of one element at position (qg, kg) of the framed attention, from
        its own Philox block (`flash_cute.reference.rng`'s rule)."""
        w = self._words(qg & Int32(~8), kg & Int32(~9))
        upper_k = (kg & Int32(8)) != Int32(0)
        low_pair = Uint32(cutlass.select_(upper_k, w[1], w[0]))
        high_pair = Uint32(cutlass.select_(upper_k, w[3], w[2]))
        word = Uint32(cutlass.select_((qg & Int32(8)) != Int32(0), high_pair, low_pair))
        bits = Uint32(cutlass.select_((kg & Int32(1)) != Int32(0), word, word << Uint32(16)))
        return bits < self.threshold

    @cute.jit
    def _walk(self, coord_mn: cute.Tensor, q0: Int32, k0: Int32, visit):
        """The group walk over the fragment, its tile's first position (q0, k0)."""
        rows, cols = cute.size(coord_mn, mode=[0]), cute.size(coord_mn, mode=[1])
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
