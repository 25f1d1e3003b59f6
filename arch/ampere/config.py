"""Compile-time choices of the Ampere pipeline (no CuTe DSL import, so the registry can read it)."""

# hdim -> (tile_m, tile_n, num_warps): the fastest spill-free shapes of a tile ablation
# (docs/decisions.md, D-AF-TILE).
FWD_SCHEDULES = {64: (128, 64, 4), 96: (64, 128, 4), 128: (128, 32, 4), 192: (128, 64, 8),
                 256: (128, 64, 8)}

# (hdim, hdim_v) pairs with a kernel: equal dims, and 192/128 (hdim_v <= hdim, multiple of 32).
SUPPORTED_HDIMS = frozenset({(d, d) for d in FWD_SCHEDULES} | {(192, 128)})

COMPILE_OPTIONS = "--opt-level 2"

# Backward: hdim -> (tile_m, tile_n, num_warps, warps of S/dP (m, n), of dK/dV (n, d),
# of dQ (m, d), Q/dO stages). FA2's sm80 shapes: a 64-row query tile against 128 keys up to hdim
# 128, 64 x 64 beyond, so that dK and dV (in registers for the whole loop) plus S, dP and dQ fit
# one thread. Two Q/dO stages let tile m+1 load under tile m's GEMMs; at hdim 192/256 a second
# stage would pass sm80's 164 KiB of shared memory.
BWD_SCHEDULES = {
    64: (64, 128, 8, (2, 4), (4, 2), (4, 2), 2),
    96: (64, 128, 8, (2, 4), (4, 2), (4, 2), 2),
    128: (64, 128, 8, (2, 4), (4, 2), (2, 4), 2),
    192: (64, 64, 8, (4, 2), (2, 4), (2, 4), 1),
    256: (64, 64, 8, (4, 2), (2, 4), (2, 4), 1),
}


def _tile_bytes(rows: int, cols: int) -> int:
    """A 16-bit (rows, cols) shared-memory tile, rounded up to the 1 KiB alignment it gets."""
    return -(-rows * cols * 2 // 1024) * 1024


def fwd_smem_bytes(hdim: int, hdim_v: int, tile: tuple) -> int:
    """Forward: Q, K and V tiles (O reuses Q's)."""
    tile_m, tile_n = tile[:2]
    return _tile_bytes(tile_m, hdim) + _tile_bytes(tile_n, hdim) + _tile_bytes(tile_n, hdim_v)


def bwd_smem_bytes(hdim: int, hdim_v: int) -> int:
    """Backward: staged Q and dO, K, V, and the P and dS tiles."""
    tile_m, tile_n, *_, stages = BWD_SCHEDULES[hdim]
    return (_tile_bytes(tile_m * stages, hdim) + _tile_bytes(tile_m * stages, hdim_v)
            + _tile_bytes(tile_n, hdim) + _tile_bytes(tile_n, hdim_v)
            + 2 * _tile_bytes(tile_m, tile_n))
