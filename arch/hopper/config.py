"""Compile-time choices of the Hopper pipeline (no CuTe DSL import, so the registry can read it)."""

# Warpgroups: one producer (TMA) and two consumers, each consumer owning 64 query rows of a
# 128-row tile (WGMMA's M is 64 per warpgroup).
NUM_CONSUMER_WARPGROUPS = 2
NUM_THREADS = 128 * (1 + NUM_CONSUMER_WARPGROUPS)
# setmaxnreg budgets (multiples of 8), as FA3 and the CUTLASS Hopper FMHA use: ptxas gives a
# 384-thread CTA 168 registers per thread at launch (65536 / 384, rounded down to 8), and
# 128 * 24 + 256 * 240 = 128 * (24 + 2 * 240) = 384 * 168, so the producer's registers go
# exactly to the consumers.
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240

# hdim -> (tile_m, tile_n, kv_stages). tile_m is fixed at 128 (two consumer warpgroups); tile_n
# shrinks as the head dim grows so that Q + 2 stages of K and V stay inside the H200's 227 KiB
# of shared memory (hdim 256: 64 + 2 * 40 + 2 * 40 KiB = 224 KiB) and the O accumulator
# (hdim_v / 2 registers per thread) plus S (tile_n / 2) fit the 240-register consumer budget.
TILES = {64: (128, 128, 2), 96: (128, 128, 2), 128: (128, 128, 2), 192: (128, 96, 2),
         256: (128, 80, 2)}

# (hdim, hdim_v) pairs with a kernel: equal dims, and 192/128 (DeepSeek's shape).
SUPPORTED_HDIMS = frozenset({(d, d) for d in TILES} | {(192, 128)})

SMEM_CAPACITY = 227 * 1024

COMPILE_OPTIONS = "--opt-level 2"


def smem_bytes(hdim: int, hdim_v: int, tile: tuple) -> int:
    """Dynamic shared memory of one CTA, laid out as `HopperFwd`'s SharedStorage: the mbarriers
    (full + empty per stage of Q, K and V) padded to the 1 KiB alignment of the swizzled tiles,
    then Q and the K and V rings."""
    tile_m, tile_n, stages = tile
    align = lambda b: -(-b // 1024) * 1024  # noqa: E731
    barriers = 8 * (2 + 4 * stages)
    return align(barriers) + align(tile_m * hdim * 2) + align(stages * tile_n * hdim * 2) \
        + align(stages * tile_n * hdim_v * 2)
