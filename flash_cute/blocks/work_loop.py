"""The persistent work loop every warp role of a kernel iterates (device side).

A CTA of a grid of G takes the tile numbers ``block_idx, block_idx + G, ...`` below
``tiles.num_numbers`` (`flash_cute.contract.tile_order`: what a number means is the kernel's
`TileOrder`), or, one CTA per tile, only its own. Each role passes its per-tile step and the
state it carries from tile to tile (pipeline states, ping-pong turns): every role then walks
the same numbers in the same order, which is what keeps their pipelines in step.
`num_sms`: the SM count a persistent grid is sized by, read when a kernel is traced.
"""

import cutlass
import cutlass.cute as cute

from flash_cute.contract.tile_order import DEFAULT_NUM_SMS


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


def num_sms(default: int = DEFAULT_NUM_SMS) -> int:
    """SMs of the current CUDA device, from the driver (host side, when a kernel is traced).

    A persistent kernel's grid is fixed when it is compiled: the launch code passes the kernel
    no SM count, and a kernel can read none that is not arch-specific. The compile cache is
    per process and a process normally sees one GPU model, so the count of the device that
    compiles is the count of the device that runs (on a mixed machine a kernel compiled on a
    larger GPU would run its extra CTAs as a second wave: correct, slower). Without a GPU
    (cross-compiling) the H100/H200 count is used."""
    try:
        from cuda.bindings import driver

        ok = driver.CUresult.CUDA_SUCCESS
        err, device = driver.cuCtxGetDevice()
        if err != ok:
            return default
        err, count = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
    except Exception:  # no driver library (a CPU-only host): cross-compiling
        return default
    return count if err == ok and count > 0 else default
