"""WGMMA helpers shared by the Hopper kernels."""

import cutlass.cute as cute
from cutlass import Int32

WARPGROUP_THREADS = 128


def wgmma_slice(tiled_mma: cute.TiledMma, wg: Int32):
    """The slice of `tiled_mma` that partitions a warpgroup's shared-memory operands.

    Every thread of a warpgroup gets the same A/B partition, so it is taken at the
    warpgroup's first thread from `wg`, a warp-uniform warpgroup index
    (`cute.arch.make_warp_uniform`). Sliced at the thread index instead, the operand addresses
    depend on a per-thread register, and ptxas builds every WGMMA descriptor in vector
    registers and moves it to uniform ones (docs/decisions.md, D-WGMMA-SLICE).
    Accumulators, and an A operand taken from registers, are per thread: they need the
    thread's own slice (`get_slice(tidx)`)."""
    return tiled_mma.get_slice(wg * WARPGROUP_THREADS)
