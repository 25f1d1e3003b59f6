"""The measured timeline of a kernel's warp roles: what an instrumented kernel records and
how the record is laid out (no torch, no DSL; the kernels write it through the block
`flash_cute.blocks.timeline`, `flash_cute.tools.timeline` reads and draws it).

A record is three int64s: the event (an index of `EVENTS`), the K/V block it belongs to
(−1 for none) and the global timer in ns. The buffer is int64 [ctas, warps, SLOTS, 3]:
each sampled CTA's warps write their own records in order (lane 0), until SLOTS are used.
"""

# Phase boundaries, in pairs where a phase has a start and an end.
EVENTS = ("load_issued", "wait_start", "wait_end", "qk_issued", "qk_done", "softmax_start",
          "softmax_end", "pv_issued", "pv_done", "epilogue_start", "epilogue_end")
EVENT = {name: i for i, name in enumerate(EVENTS)}
# Intervals drawn and measured: (name, start event, end event). The forward's "scores GEMM"
# is S = Q Kᵀ and its "output GEMM" O += P V; the backward's are S and dP, then dV, dK, dQ;
# its "softmax" is P and dS; its "waiting" is for Q and dO (a block is then a query tile).
PHASES = (("waiting", "wait_start", "wait_end"), ("scores GEMM", "qk_issued", "qk_done"),
          ("softmax", "softmax_start", "softmax_end"), ("output GEMM", "pv_issued", "pv_done"),
          ("epilogue", "epilogue_start", "epilogue_end"))
GEMMS = ("scores GEMM", "output GEMM")
# 185 blocks of 11 records: a whole 8k-token tile of the forward's 128 keys or the
# backward's 64-row query tiles, and 16k in the forward.
SLOTS = 2048
FIELDS = 3


def buffer_shape(ctas: int, warps: int) -> tuple:
    """The record buffer's shape for `ctas` sampled CTAs of `warps` warps."""
    return (ctas, warps, SLOTS, FIELDS)
