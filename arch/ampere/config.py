"""Compile-time choices of the Ampere pipeline (no CuTe DSL import, so the registry can read it)."""

# hdim -> (tile_m, tile_n, num_warps). With 4 warps a thread holds 32 rows' share of O and S,
# which spills at hdim 64, 96 and 128 (inspect: 16-90 B); 8 warps (16 rows each) fit in
# 180-245 registers with no spill.
TILES = {64: (128, 128, 8), 96: (128, 128, 8), 128: (128, 128, 8), 192: (128, 64, 8),
         256: (128, 64, 8)}

# (hdim, hdim_v) pairs with a kernel: equal dims, and 192/128 (hdim_v <= hdim, multiple of 32).
SUPPORTED_HDIMS = frozenset({(d, d) for d in TILES} | {(192, 128)})

COMPILE_OPTIONS = "--opt-level 2"

# Backward: hdim -> (tile_m, tile_n, num_warps, warps of S/dP (m, n), of dK/dV (n, d), of dQ (m, d)).
# FA2's sm80 shapes: a 64-row query tile against 128 keys up to hdim 128, 64 x 64 beyond, so
# that dK and dV (held in registers for the whole loop) plus S, dP and dQ fit one thread.
BWD_TILES = {
    64: (64, 128, 8, (2, 4), (4, 2), (4, 2)),
    96: (64, 128, 8, (2, 4), (4, 2), (4, 2)),
    128: (64, 128, 8, (2, 4), (4, 2), (2, 4)),
    192: (64, 64, 8, (4, 2), (2, 4), (2, 4)),
    256: (64, 64, 8, (4, 2), (2, 4), (2, 4)),
}
