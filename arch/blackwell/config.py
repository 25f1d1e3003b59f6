"""The blackwell forward's compile-time choices and the sm100 budgets they must fit.

Why each default is what it is: docs/decisions.md (D-BW-*). Nothing here imports the CuTe DSL,
so the budgets are checked on the host (`tests/test_blackwell.py`) without compiling.
"""

from typing import NamedTuple

# Shared memory per CTA on sm100 (B200): 227 KiB usable of 228, the kernel's static 1 KiB
# (the DSL's) included.
SMEM_CAPACITY = 232448
STATIC_SMEM = 1024
# Tensor memory: 128 lanes x 512 columns of 32 bits per SM; an allocation is a power of two
# from 32 to 512 columns.
TMEM_COLUMNS = 512
COMPILE_OPTIONS = "--opt-level 2"  # D-BW-OPT
# Query rows per Q tile (the tcgen05 MMA's M with one CTA) and Q tiles per CTA (one per
# softmax warpgroup, ping-ponged through the tensor core).
TILE_M = 128
Q_STAGES = 2
# Registers per thread of each warpgroup (setmaxnreg; multiples of 8, summing to 4 x 128 so
# that all 65536 go to a role): softmax 0, softmax 1, correction, MMA / load / idle (D-BW-ROLES).
ROLE_REGISTERS = (192, 192, 88, 40)
# FA4's conditional rescale (D-BW-RESCALE): the running max moves only when a block's max
# exceeds it by more than this, in exp2 units.
RESCALE_THRESHOLD = 8.0
# SMs of a B200, for a persistent grid compiled without a GPU.
DEFAULT_NUM_SMS = 148


class FwdSchedule(NamedTuple):
    """tile_n: keys per K/V block; k_stages / v_stages: the K and V rings' depths;
    persistent: a grid of at most one CTA per SM walking the tiles."""
    tile_n: int
    k_stages: int
    v_stages: int
    persistent: bool = True


# (hdim, hdim_v) -> schedule: as many ring stages as fit beside the two Q tiles
# (`smem_bytes`), K at least two deep so the next QKᵀ's operand lands under this block's PVs.
FWD_SCHEDULES = {
    (64, 64): FwdSchedule(128, 4, 4),
    (128, 128): FwdSchedule(128, 2, 2),
    (192, 128): FwdSchedule(128, 2, 1),
}
SUPPORTED_HDIMS = tuple(sorted(FWD_SCHEDULES))


def default_ex2_per16(hdim: int, causal: bool) -> int:
    """Of every 16 scores, how many take the FMA exp2 (`exp2_emu`) by default: FA4's shares
    per case (D-BW-EX2): 2/16 (12.5 %) up to hdim 128, 1/16 for causal hdim 192, whose
    longer QKᵀ leaves MUFU less behind."""
    if hdim > 128:
        return 1 if causal else 2
    return 2


class TmemPlan(NamedTuple):
    """Tensor-memory columns (fp32) of S0, S1, O0, O1 and the allocation; P_i (16-bit, two
    per column) takes the upper half of S_i's columns."""
    s: tuple
    o: tuple
    p: tuple
    columns: int


def tmem_plan(tile_n: int, hdim_v: int) -> TmemPlan:
    """S_i is tile_n columns, O_i hdim_v; P_i aliases S_i's upper half: the MMA warp issues
    PV_i(j-1) before QKᵀ_i(j), and tcgen05 MMAs of one thread run in order, so P is read
    before S overwrites it."""
    s = (0, tile_n)
    o = (2 * tile_n, 2 * tile_n + hdim_v)
    p = tuple(x + tile_n // 2 for x in s)
    used = o[1] + hdim_v
    if used > TMEM_COLUMNS:
        raise ValueError(f"tensor memory: {used} columns needed, {TMEM_COLUMNS} exist")
    columns = 32
    while columns < used:
        columns *= 2
    return TmemPlan(s, o, p, columns)


def _tile_bytes(rows: int, cols: int, elem_bytes: int = 2) -> int:
    return rows * cols * elem_bytes


def smem_bytes(hdim: int, hdim_v: int, schedule: FwdSchedule) -> int:
    """Dynamic shared memory of the kernel's SharedStorage: the barriers, the softmax
    hand-over (2 tiles x 128 rows, fp32), then the 1 KiB-aligned Q (two tiles), K and V
    rings. The kernel's 1 KiB of static shared memory comes on top (`STATIC_SMEM`)."""
    barriers = 8 * (2 * Q_STAGES + 2 * schedule.k_stages + 2 * schedule.v_stages + 3 * 2
                    + 2 * 2) + 4
    head = _align(barriers, 16) + 4 * Q_STAGES * TILE_M
    tiles = (Q_STAGES * _tile_bytes(TILE_M, hdim)
             + schedule.k_stages * _tile_bytes(schedule.tile_n, hdim)
             + schedule.v_stages * _tile_bytes(schedule.tile_n, hdim_v))
    return _align(head, 1024) + tiles


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to
