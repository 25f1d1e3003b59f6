"""Block: a warp's phase boundaries recorded with the global timer, for the measured timeline
(`flash_cute.contract.timeline`; a kernel compiled with `Variant.timeline`).

Lane 0 of each warp writes (event, block, ns) into its own row of the record buffer. Only the
first `ctas` CTAs record, and only their first tile, so the slots need no counter: a
record's slot is fixed by the block's place in the tile's visiting order and the event (the
epilogue's after the blocks'), and nothing has to be carried through the kernel's loops.
A kernel compiled without the switch holds no `Timeline` and reads no timer.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.timeline import EVENT, EVENTS, SLOTS

# Blocks of a tile whose records are kept (the rest of a long tile is not recorded).
BLOCKS = (SLOTS - len(EVENTS)) // len(EVENTS)


class Timeline(DslState):
    """One warp's recorder for one tile: `on` for a sampled CTA's first tile; `first`: the
    index of the tile's first block visited, `descending` whether blocks are visited right to
    left (the forward's K/V blocks; the backward's query tiles run left to right)."""

    def __init__(self, buffer: cute.Tensor, warp: Int32, on, first: Int32,
                 descending: bool = True):
        self.buffer, self.warp, self.on, self.first = buffer, warp, on, first
        self.descending = descending

    @staticmethod
    def of_warp(buffer: cute.Tensor, on, first: Int32, descending: bool = True):
        """This warp's recorder in `buffer` [ctas, warps, SLOTS, 3], recording where `on`."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        return Timeline(buffer, warp, on, first, descending)

    @staticmethod
    def for_tile(buffer, tile: Int32, first_block: Int32, descending: bool = True):
        """The recorder of this warp for tile number `tile` of the CTA: the first tile of
        the first CTAs records."""
        bid = cute.arch.block_idx()[0]
        on = (tile == bid) & (bid < buffer.shape[0])
        return Timeline.of_warp(buffer, on, first_block, descending)

    @cute.jit
    def record(self, event: cutlass.Constexpr, block: Int32):
        """Event `event` (a name of `EVENTS`) of K/V block `block` (−1: the tile's epilogue)."""
        if self.on:
            if cute.arch.lane_idx() == 0:
                slot = Int32(BLOCKS * len(EVENTS) + EVENT[event])
                if block >= Int32(0):
                    order = self.first - block if self.descending else block - self.first
                    slot = order * len(EVENTS) + EVENT[event]
                    if order >= Int32(BLOCKS):
                        slot = Int32(-1)
                if slot >= Int32(0):
                    row = self.buffer[cute.arch.block_idx()[0], self.warp, slot, None]
                    row[0] = Int64(EVENT[event])
                    row[1] = Int64(block)
                    row[2] = cute.arch.globaltimer()
