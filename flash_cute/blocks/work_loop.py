"""The persistent work loop every warp role of a kernel iterates (device side).

A CTA of a grid of G takes the tile numbers ``block_idx, block_idx + G, ...`` below
``tiles.num_numbers`` (`flash_cute.contract.tile_order`: what a number means is the kernel's
`TileOrder`), or, one CTA per tile, only its own. Each role passes its per-tile step and the
state it carries from tile to tile (pipeline states, ping-pong turns): every role then walks
the same numbers in the same order, which is what keeps their pipelines in step.
"""

import cutlass
import cutlass.cute as cute


@cute.jit
def for_each_tile(tiles, persistent: cutlass.Constexpr[bool], step: cutlass.Constexpr, state):
    """``state = step(tile, *state)`` for each of this CTA's tile numbers; returns the final
    state. `tiles.num_numbers` (read only when `persistent`): the numbers the grid walks."""
    first = cute.arch.block_idx()[0]
    if cutlass.const_expr(persistent):
        for tile in cutlass.range(first, tiles.num_numbers, cute.arch.grid_dim()[0], unroll=1):
            state = step(tile, *state)
    else:
        state = step(first, *state)
    return state
