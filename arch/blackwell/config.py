"""The blackwell forward's compile-time choices and the sm100 budgets they must fit.

Why each default is what it is: docs/decisions.md (D-BW-*). Nothing here imports the CuTe DSL,
so the budgets are checked on the host (`tests/test_blackwell.py`) without compiling.
"""

from typing import NamedTuple

from flash_cute.contract.block_range import block_range

# Shared memory per CTA on sm100 (B200): 227 KiB usable of 228, the kernel's static 1 KiB
# (the DSL's) included.
SMEM_CAPACITY = 232448
STATIC_SMEM = 1024
# Tensor memory: 128 lanes x 512 columns of 32 bits per SM; an allocation is a power of two
# from 32 to 512 columns.
TMEM_COLUMNS = 512
COMPILE_OPTIONS = "--opt-level 2"  # D-BW-OPT
# Query rows per Q tile (the tcgen05 MMA's M with one CTA) and Q tiles per CTA (one per
# softmax warpgroup, ping-ponged through the tensor core) where two fit (`FwdSchedule.q_tiles`).
TILE_M = 128
Q_STAGES = 2
# Registers per thread of each warpgroup (setmaxnreg; multiples of 8, at most 4 x 128 in
# all): softmax 0, softmax 1, correction, MMA / load / idle (D-BW-ROLES). With one Q tile the
# second softmax warpgroup idles at the least setmaxnreg allows.
ROLE_REGISTERS = (192, 192, 88, 40)
ROLE_REGISTERS_ONE_TILE = (192, 24, 88, 40)
# FA4's conditional rescale (D-BW-RESCALE): the running max moves only when a block's max
# exceeds it by more than this, in exp2 units.
RESCALE_THRESHOLD = 8.0
# SMs of a B200, for a persistent grid compiled without a GPU.
DEFAULT_NUM_SMS = 148


class FwdSchedule(NamedTuple):
    """tile_n: keys per K/V block; k_stages / v_stages: the K and V rings' depths;
    persistent: a grid of at most one CTA per SM walking the tiles; q_tiles: 128-row Q tiles
    per CTA, 2 (one per softmax warpgroup, ping-ponged) or 1 (one softmax warpgroup whose
    blocks alternate between two S buffers, `BlackwellFwd`)."""
    tile_n: int
    k_stages: int
    v_stages: int
    persistent: bool = True
    q_tiles: int = Q_STAGES


# (hdim, hdim_v) -> schedule: as many ring stages as fit beside the Q tiles (`smem_bytes`), K
# at least two deep so the next QKᵀ's operand lands under this block's PVs. At hdim 256 two
# O accumulators (512 columns) leave no room for S, so one Q tile runs with S double-buffered,
# and 64-key blocks let three K and two V stages fit beside it (D-BW-HD256).
FWD_SCHEDULES = {
    (64, 64): FwdSchedule(128, 4, 4),
    (128, 128): FwdSchedule(128, 2, 2),
    (192, 128): FwdSchedule(128, 2, 1),
    (256, 256): FwdSchedule(64, 3, 2, True, 1),
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
    """Tensor-memory columns (fp32) of the two S buffers, of O per Q tile, and the
    allocation; P_i (16-bit, two per column) takes the upper half of S_i's columns."""
    s: tuple
    o: tuple
    p: tuple
    columns: int


def tmem_plan(tile_n: int, hdim_v: int, q_tiles: int = Q_STAGES) -> TmemPlan:
    """S_i is tile_n columns, O_i hdim_v; P_i aliases S_i's upper half: the MMA warp issues
    the PV that reads P_i before the next QKᵀ into S_i, and tcgen05 MMAs of one thread run in
    order, so P is read before S overwrites it. Two S buffers either way: one per Q tile, or
    with one Q tile its blocks in turn."""
    s = (0, tile_n)
    o = tuple(2 * tile_n + i * hdim_v for i in range(q_tiles))
    p = tuple(x + tile_n // 2 for x in s)
    used = o[-1] + hdim_v
    if used > TMEM_COLUMNS:
        raise ValueError(f"tensor memory: {used} columns needed, {TMEM_COLUMNS} exist")
    columns = 32
    while columns < used:
        columns *= 2
    return TmemPlan(s, o, p, columns)


def _tile_bytes(rows: int, cols: int, elem_bytes: int = 2) -> int:
    return rows * cols * elem_bytes


def smem_bytes(hdim: int, hdim_v: int, schedule: FwdSchedule) -> int:
    """Dynamic shared memory of the kernel's SharedStorage: the barriers (the Q, K and V
    rings', s_full and p_ready per S buffer, o_full and the hand-over's per Q tile), the
    softmax hand-over (128 rows per Q tile, fp32), then the 1 KiB-aligned Q tiles, K and V
    rings. The kernel's 1 KiB of static shared memory comes on top (`STATIC_SMEM`)."""
    qt = schedule.q_tiles
    barriers = 8 * (2 * qt + 2 * schedule.k_stages + 2 * schedule.v_stages + 2 * 2 + qt
                    + 2 * qt) + 4
    head = _align(barriers, 16) + 4 * qt * TILE_M
    tiles = (qt * _tile_bytes(TILE_M, hdim)
             + schedule.k_stages * _tile_bytes(schedule.tile_n, hdim)
             + schedule.v_stages * _tile_bytes(schedule.tile_n, hdim_v))
    return _align(head, 1024) + tiles


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# ------------------------------------------------------------------------------ the backward
#
# A cluster of `cta_group` CTAs (the pair when 2) owns a K/V tile of cta_group x tile_n rows
# and walks the query tiles that see it. Each CTA holds its own tile_n rows of K and V (the
# MMAs' A operand, M split by CTA); the B operands are split by N between the pair, so each
# CTA loads half of every Q, dO and Kᵀ tile (`pair_*` below). Why each choice: docs/decisions.md
# (D-BW-BWD-*).


class BwdSchedule(NamedTuple):
    """tile_m: query rows per step; tile_n: K/V rows per CTA; q_stages: depth of the Q ring;
    cta_group: CTAs per MMA (2: tcgen05 cta_group::2, the K/V tile spans the pair); cluster:
    the launch's cluster shape; do_stages: depth of the dO ring; dq_chunk: dQ columns the
    reduce warps move from TMEM at once."""
    tile_m: int
    tile_n: int
    q_stages: int
    cta_group: int = 1
    cluster: tuple = (1, 1, 1)
    do_stages: int = 1
    dq_chunk: int = 32


# (hdim, hdim_v) -> schedule. hdim 64 runs one CTA per K/V tile (D-BW-BWD-1CTA); from 128 up
# the pair shares each 256-row K/V tile (D-BW-BWD-PAIR); at 256 a 128-row one, 64 keys a CTA,
# since dK and dV of 128 keys would fill the tensor memory alone (D-BW-BWD-HD256).
BWD_SCHEDULES = {
    (64, 64): BwdSchedule(128, 128, 2, 1, (1, 1, 1), 1, 32),
    (128, 128): BwdSchedule(128, 128, 1, 2, (2, 1, 1), 1, 32),
    (192, 128): BwdSchedule(128, 128, 1, 2, (2, 1, 1), 1, 32),
    (256, 256): BwdSchedule(128, 64, 1, 2, (2, 1, 1), 1, 32),
}
BWD_HDIMS = tuple(sorted(BWD_SCHEDULES))
# Registers per thread of each warpgroup in the backward (setmaxnreg, summing to 4 x 128):
# dQ reduce (warps 0..3), compute 0 (4..7), compute 1 (8..11), MMA / load / relay / tail.
BWD_ROLE_REGISTERS = (88, 160, 160, 104)


def folds(schedule: BwdSchedule) -> bool:
    """Whether the pair's key-side MMAs (Sᵀ, dPᵀ, dV, dK) run at M = 128, 64 keys a CTA: each
    CTA's 64 rows then fold into 128 lanes by halves of N (`acc_columns`), so a compute
    thread holds half a key's row, and Pᵀ and dSᵀ reach the dV and dK MMAs through shared
    memory (D-BW-BWD-HD256)."""
    return schedule.cta_group == 2 and schedule.cta_group * schedule.tile_n == 128


def acc_columns(m: int, n: int, cta_group: int) -> int:
    """TMEM columns per CTA of an fp32 accumulator of an (m x n) tcgen05 MMA: one lane a row
    with one CTA or with the pair at m = 256 (each CTA holds its 128 rows); with the pair at
    m = 128 each CTA holds 64 rows, folded into 128 lanes by halves of n."""
    if cta_group == 2 and m == 128:
        return n // 2
    return n


class BwdTmemPlan(NamedTuple):
    """First TMEM column of each accumulator (fp32) of one CTA: Sᵀ, dPᵀ, dV, dK, dQ; Pᵀ
    (16-bit, two per column, `tile_m / 2` columns) takes the lower half of Sᵀ's columns, dSᵀ
    the middle half of dPᵀ's (from a quarter in: each compute warpgroup's words then lie over
    its own query columns of dPᵀ, `ds_words_first`). `width` maps each name to its columns,
    `columns` is the allocation. A name with a part, "s.1", is compute warpgroup 1's half of
    that region (`region`)."""
    s: int
    dp: int
    dv: int
    dk: int
    dq: int
    width: dict
    columns: int

    def region(self, name: str) -> range:
        base, _, part = name.partition(".")
        start = {"p": self.s, "ds": self.dp + self.width["dp"] // 4}.get(
            base, getattr(self, base, None))
        width = self.width[base]
        if part:
            width //= 2
            start += int(part) * width
        return range(start, start + width)


def bwd_tmem_plan(hdim: int, hdim_v: int, schedule: BwdSchedule) -> BwdTmemPlan:
    """dV and dK (live for the whole K/V tile) from column 0; then Sᵀ, dPᵀ and dQ (live for
    one query tile) side by side where they fit. Where they do not, dQ takes the columns that
    die first: Sᵀ's upper half (dead once Pᵀ is written below it) when dPᵀ still fits beside
    Sᵀ, else dPᵀ moves over Sᵀ's upper half and dQ ends the plan over the dead part of dPᵀ
    (dSᵀ, in dPᵀ's lower half, is read by the dK MMA before the dQ MMA writes: one thread
    issues both, in order). `tests/test_blackwell_bwd_model.py` replays a step's accesses
    against this plan."""
    g, tm = schedule.cta_group, schedule.tile_m
    m = g * schedule.tile_n
    width = {"s": acc_columns(m, tm, g), "dp": acc_columns(m, tm, g),
             "dv": acc_columns(m, hdim_v, g), "dk": acc_columns(m, hdim, g),
             "dq": acc_columns(tm, hdim, g)}
    width["p"], width["ds"] = width["s"] // 2, width["dp"] // 2
    dv, dk = 0, width["dv"]
    s = dk + width["dk"]
    dp = s + width["s"]
    dq = dp + width["dp"]
    if dq + width["dq"] > TMEM_COLUMNS:
        if width["dq"] <= width["s"] - width["p"]:
            dq = s + width["p"]  # over Sᵀ's upper half
        else:
            dp = s + width["p"]  # dPᵀ over Sᵀ's upper half, dQ over dPᵀ's end
            dq = TMEM_COLUMNS - width["dq"]
    used = max(dq + width["dq"], dp + width["dp"])
    if used > TMEM_COLUMNS:
        raise ValueError(f"tensor memory: {used} columns needed, {TMEM_COLUMNS} exist")
    columns = 32
    while columns < used:
        columns *= 2
    return BwdTmemPlan(s, dp, dv, dk, dq, width, columns)


def bwd_smem_slots(hdim: int, hdim_v: int, schedule: BwdSchedule, elem_bytes: int = 2) -> dict:
    """Shared-memory tiles of one CTA of the backward, name -> bytes, each 1 KiB-aligned
    (swizzled MMA operands). K and V (A operands, this CTA's rows) stay for the whole K/V
    tile. Q, dO and Kᵀ are B operands: with the pair each CTA holds its half of N, so Sᵀ = K Qᵀ
    takes tile_m / 2 query rows of Q while dK = dSᵀ Q takes hdim / 2 columns of all tile_m
    rows ("qt"; "dot" and "kt" likewise). With one CTA those are the same tiles read through
    MN-major views. Where the separate Qᵀ and dOᵀ tiles do not fit, Qᵀ (dOᵀ) is loaded into
    Q's (dO's) slot once the Sᵀ (dPᵀ) MMA has read it ("qt", "dot" absent:
    `shares_transposed`). "ds" is the dQ MMA's A operand: tile_m / cta_group query rows of the
    cluster's keys; with the pair, "xchg" stages the rows this CTA computes for the peer,
    which one bulk copy then sends (`pair.copy_to_peer`). Folded (`folds`), "pt" and "dst"
    hold this CTA's keys' rows of Pᵀ and dSᵀ, the dV and dK MMAs' A operands."""
    g, tm, tn = schedule.cta_group, schedule.tile_m, schedule.tile_n
    slots = {"k": tn * hdim * elem_bytes, "v": tn * hdim_v * elem_bytes,
             "q": schedule.q_stages * (tm // g) * hdim * elem_bytes,
             "do": schedule.do_stages * (tm // g) * hdim_v * elem_bytes,
             "ds": (tm // g) * (g * tn) * elem_bytes}
    if g > 1:
        slots["kt"] = (hdim // g) * (g * tn) * elem_bytes
        slots["xchg"] = (tm // g) * tn * elem_bytes
    if folds(schedule):
        slots["pt"] = slots["dst"] = tn * tm * elem_bytes
    if g > 1:
        transposed = {"qt": schedule.q_stages * tm * (hdim // g) * elem_bytes,
                      "dot": schedule.do_stages * tm * (hdim_v // g) * elem_bytes}
        if _slots_total({**slots, **transposed}, schedule) + STATIC_SMEM <= SMEM_CAPACITY:
            slots.update(transposed)
    return slots


# mbarriers per ring stage: bytes full, MMA done (empty), and operands ready (each CTA's tail
# warp's arrival after zeroing rows past the sequence, `pair.TmaRing`; unused without varlen
# or seqused, where a TMA zero-fills what lies past the tensor).
RING_STAGE_BARRIERS = 3


def bwd_barrier_count(schedule: BwdSchedule, separate_transposed: bool) -> int:
    """mbarriers of the backward: the full / empty / ready barriers of the K/V, Q and dO
    rings' stages (and of the Qᵀ and dOᵀ rings when they have their own tiles), the
    handshakes (`BWD_BARRIERS`) and the pair's TMEM dealloc barrier."""
    rings = 1 + schedule.q_stages + schedule.do_stages
    if separate_transposed:
        rings += schedule.q_stages + schedule.do_stages
    return RING_STAGE_BARRIERS * rings + len(BWD_BARRIERS) + 1


def _head_bytes(schedule: BwdSchedule, separate_transposed: bool) -> int:
    """The barriers, the TMEM address word, then LSE₂ and Δ of the step's queries (fp32, two
    buffers)."""
    bars = 8 * bwd_barrier_count(schedule, separate_transposed) + 4
    return _align(bars, 16) + 2 * 2 * 4 * schedule.tile_m


def _slots_total(slots: dict, schedule: BwdSchedule) -> int:
    head = _head_bytes(schedule, "qt" in slots)
    return _align(head, 1024) + sum(_align(b, 1024) for b in slots.values())


def bwd_smem_bytes(hdim: int, hdim_v: int, schedule: BwdSchedule) -> int:
    """Dynamic shared memory of the backward's SharedStorage (`bwd_smem_slots` after
    `_head_bytes`); the 1 KiB static comes on top (`STATIC_SMEM`)."""
    return _slots_total(bwd_smem_slots(hdim, hdim_v, schedule), schedule)


def shares_transposed(hdim: int, hdim_v: int, schedule: BwdSchedule) -> bool:
    """Whether Qᵀ and dOᵀ are loaded into Q's and dO's slots (`bwd_smem_slots`)."""
    return schedule.cta_group > 1 and "qt" not in bwd_smem_slots(hdim, hdim_v, schedule)


# The pair's work split. Pure integer arithmetic, so the kernel (on DSL integers) and the
# float64 model of the split (`tests/test_blackwell_bwd_model.py`) call the same functions.

def pair_kv_first(n_tile, rank, schedule: BwdSchedule):
    """First K/V row of CTA `rank` of the cluster that owns K/V tile `n_tile` (of
    cta_group x tile_n rows): the rows of its Sᵀ, dPᵀ, dK and dV (the MMAs' M half)."""
    return (n_tile * schedule.cta_group + rank) * schedule.tile_n


def pair_q_first(m_block, rank, schedule: BwdSchedule):
    """First query row of query tile `m_block` that CTA `rank` loads for the Sᵀ and dPᵀ MMAs
    (their B operand's N half: tile_m / cta_group rows, with all hdim columns) and whose dQ it
    computes (the dQ MMA's M half) and adds."""
    return m_block * schedule.tile_m + rank * (schedule.tile_m // schedule.cta_group)


def pair_col_first(rank, hdim: int, schedule: BwdSchedule):
    """First column of Qᵀ, dOᵀ and Kᵀ that CTA `rank` loads for the dK, dV and dQ MMAs (their B
    operand's N half: hdim / cta_group columns, all rows)."""
    return rank * (hdim // schedule.cta_group)


def pair_exchange_first(rank, schedule: BwdSchedule):
    """Where CTA `rank`'s dS reaches the dQ MMA: the keys of its rows (tile_n of them) start at
    this column of dS (query rows x the pair's keys) in both CTAs' shared memory. It writes
    the query rows of its own half there, and those of the peer's half at the same place in
    the peer's dS (distributed shared memory, signalled on the peer's mbarrier)."""
    return rank * schedule.tile_n


def wg_query_columns(schedule: BwdSchedule) -> int:
    """Query columns of Sᵀ a compute thread handles: its warpgroup's half of the tile (64),
    folded its warpgroup's half of its lane's half (32)."""
    return schedule.tile_m // (4 if folds(schedule) else 2)


def compute_thread(lane, schedule: BwdSchedule):
    """(key in the CTA's tile, lane half) of compute thread `lane` (0..127): a TMEM lane is a
    key, folded the pair's fold (`acc_columns`): lane = key + 64 x (half of N)."""
    if folds(schedule):
        return lane % schedule.tile_n, lane // schedule.tile_n
    return lane, lane * 0  # a zero of lane's type: the kernel's is a run-time Int32


def compute_query(wg, part, chunk, schedule: BwdSchedule, chunk_cols: int):
    """The query column (in the tile) where compute warpgroup `wg`'s chunk `chunk` (of
    `chunk_cols` columns) of a thread with lane half `part` starts; its TMEM column in Sᵀ
    and dPᵀ is this less part x tile_m / 2."""
    return part * (schedule.tile_m // 2) + wg * wg_query_columns(schedule) + chunk * chunk_cols


def stats_entry(lane, wg, schedule: BwdSchedule):
    """(entry, kind, query column) that thread `lane` of compute warpgroup `wg` stages into
    its warpgroup's LSE₂ (kind 0, threads 0..63) and Δ (kind 1, 64..127) table: entry e
    holds the query column of the e-th the warpgroup handles (its 64; folded, 32 of each
    lane half), where `stats_slot` looks it up."""
    half = schedule.tile_m // 2
    cols = wg_query_columns(schedule)
    entry = lane % half
    return entry, lane // half, compute_query(wg, entry // cols, 0, schedule, 1) + entry % cols


def stats_slot(part, column, schedule: BwdSchedule):
    """The table entry of a compute thread's query column `column` (counted from its
    warpgroup's first, `compute_query` at chunk 0) for a lane half `part`."""
    return part * wg_query_columns(schedule) + column


def query_owner(wg, part, schedule: BwdSchedule):
    """The pair's CTA whose dQ rows (`pair_q_first`) a compute thread's query columns are:
    its warpgroup's, folded its lane half's."""
    return part if folds(schedule) else wg


def pair_tiles(seqlen_k, schedule: BwdSchedule):
    """K/V tiles (clusters) of a sequence: ceil(seqlen_k / (cta_group x tile_n))."""
    span = schedule.cta_group * schedule.tile_n
    return (seqlen_k + span - 1) // span


def dq_turn_of_pair(n_tile, m_block, schedule: BwdSchedule, seqlen_q, seqlen_k, causal: bool,
                    window_left=None, window_right=None, *, imin=min, imax=max):
    """Deterministic dQ: the place of K/V tile `n_tile` among the tiles that add into query
    tile `m_block`, counted in clusters, not CTAs. The tiles that see `m_block` are exactly
    `block_range` at the cluster's key span (tight, like `m_block_range`), so every turn is
    taken."""
    rng = block_range(m_block, schedule.tile_m, schedule.cta_group * schedule.tile_n, seqlen_q,
                      seqlen_k, causal, window_left, window_right, imin=imin, imax=imax)
    return n_tile - rng.n_block_min


def dq_turn_pending(semaphore, turn, schedule: BwdSchedule):
    """Whether a CTA whose cluster has turn `turn` must still wait to add its dQ rows of a
    query tile, the tile's semaphore reading `semaphore`. Every CTA adds 1 once its add is
    complete, so the semaphore counts CTAs; a turn is taken by the cluster's `cta_group` CTAs,
    which add disjoint query rows (`pair_q_first`) and may go together: the turn has come
    once the clusters before have all added, semaphore // cta_group == turn. (Waiting for
    semaphore == turn, turns counted in CTAs, would hang the second cluster.)"""
    return semaphore // schedule.cta_group != turn


# One query tile's TMEM accesses in the backward, in each role's program order: (event, role,
# reads, writes); compute warpgroup w's halves are "s.w" and the like (`BwdTmemPlan.region`).
# The MMAs read Pᵀ and dSᵀ from TMEM (the dV and dK MMAs' A operand); the dQ MMA reads dS
# from shared memory.
BWD_TMEM_STEP = (
    ("S", "mma", (), ("s",)),
    ("dP", "mma", (), ("dp",)),
    ("dV", "mma", ("p.0", "p.1", "dv"), ("dv",)),
    ("dK", "mma", ("ds.0", "ds.1", "dk"), ("dk",)),
    ("dQ", "mma", (), ("dq",)),
    ("load S 0", "compute 0", ("s.0",), ()),
    ("store P 0", "compute 0", (), ("p.0",)),
    ("load dP 0", "compute 0", ("dp.0",), ()),
    ("store dS 0", "compute 0", (), ("ds.0",)),
    ("load S 1", "compute 1", ("s.1",), ()),
    ("store P 1", "compute 1", (), ("p.1",)),
    ("load dP 1", "compute 1", ("dp.1",), ()),
    ("store dS 1", "compute 1", (), ("ds.1",)),
    ("load dQ", "reduce", ("dq",), ()),
)
# The barriers every plan has, as (signalling event, waiting event, steps later): Sᵀ full,
# dPᵀ full, Pᵀ full, dSᵀ full (this CTA's and, for dQ, the peer's half), dQ full, dQ empty;
# and compute 1's P waiting for compute 0's Sᵀ (its words lie over compute 0's columns 32..,
# a named barrier, `BlackwellBwd._in_order`).
BWD_TMEM_BARRIERS = (
    ("S", "load S 0", 0), ("S", "load S 1", 0), ("dP", "load dP 0", 0),
    ("dP", "load dP 1", 0), ("store P 0", "dV", 0), ("store P 1", "dV", 0),
    ("store dS 0", "dK", 0), ("store dS 1", "dK", 0), ("store dS 0", "dQ", 0),
    ("store dS 1", "dQ", 0), ("dQ", "load dQ", 0), ("load dQ", "dQ", 1),
    ("load S 0", "store P 1", 0),
)


def bwd_tmem_step(schedule: BwdSchedule) -> tuple:
    """`BWD_TMEM_STEP` as `schedule` runs it: folded (`folds`), Pᵀ and dSᵀ go through shared
    memory, so their stores write, and the dV and dK MMAs read, no tensor memory (the
    events and their barriers, P_FULL and DS_FULL, stay: they order those stores and the
    compute warps' loads before them)."""
    if not folds(schedule):
        return BWD_TMEM_STEP
    def tmem(names):
        return tuple(n for n in names if n.split(".")[0] not in ("p", "ds"))
    return tuple((e, role, tmem(reads), tmem(writes)) for e, role, reads, writes in
                 BWD_TMEM_STEP)


def chunk_of(c, wg, chunks: int):
    """The query-column chunk (of `chunks`) compute warpgroup `wg` handles at its c-th pass:
    ascending for warpgroup 1, descending for 0, so that each dS word a pass stores lies
    over dPᵀ columns of a chunk already loaded (`ds_words_first`). Integer arithmetic: the
    kernel calls it with a run-time `wg`."""
    return c + (1 - wg) * (chunks - 1 - 2 * c)


def ds_words_first(plan: BwdTmemPlan, wg: int, query_col: int) -> int:
    """The TMEM column holding dSᵀ's word of query column `query_col` (of the warpgroup's 64,
    two 16-bit values a column) for compute warpgroup `wg`."""
    return plan.region("ds").start + (wg * plan.width["dp"] // 2 + query_col) // 2


def _overlap(plan: BwdTmemPlan, a: str, b: str) -> bool:
    ra, rb = plan.region(a), plan.region(b)
    return ra.start < rb.stop and rb.start < ra.stop


def bwd_tmem_waits(plan: BwdTmemPlan) -> dict:
    """The waits a plan's aliasing adds to `BWD_TMEM_BARRIERS`, name -> the edges (signalling
    event, waiting event, steps later) where needed: "s_read" (the dPᵀ MMA waits until both
    compute warpgroups hold their Sᵀ: dPᵀ lies over Sᵀ's upper half) and "dq_read" (the next
    Sᵀ MMA waits until the reduce warps hold dQ: dQ lies over Sᵀ's or dPᵀ's columns, and the
    dPᵀ MMA comes after the Sᵀ one). The kernel takes these from here;
    `tests/test_blackwell_bwd_model.py` replays the step against the plan with and without
    them."""
    waits = {}
    if _overlap(plan, "dp", "s"):
        waits["s_read"] = (("load S 0", "dP", 0), ("load S 1", "dP", 0))
    if _overlap(plan, "dq", "s") or _overlap(plan, "dq", "dp"):
        waits["dq_read"] = (("load dQ", "S", 1),)
    return waits


# The backward's handshake barriers (`pair.PairSync`), by index into one MemRange.
BWD_BARRIERS = ("S_FULL", "DP_FULL", "S_READ", "P_FULL", "DS_FULL", "SDS_FULL", "SDS_EMPTY",
                "DQ_FULL", "DQ_READ", "DKV_FULL", "PEER_SDS")
# Warps of each arriving role per CTA (one elected lane a warp arrives).
BWD_COMPUTE_WARPS = 8
BWD_REDUCE_WARPS = 4


def bwd_arrival_counts(cta_group: int) -> dict:
    """Arrivals that complete each handshake barrier's phase. "MMA done" ones (S_FULL,
    DP_FULL, SDS_EMPTY, DQ_FULL, DKV_FULL): one tcgen05.commit, sent to both CTAs. The
    leader's "MMA may go on" ones: every arriving warp of both CTAs. dS in shared memory
    (SDS_FULL, per CTA): its local writers' warps, and with the pair the peer's arm of its
    copy's bytes. PEER_SDS (the leader's): the relay's one arrival."""
    g = cta_group
    return {"S_FULL": 1, "DP_FULL": 1, "SDS_EMPTY": 1, "DQ_FULL": 1, "DKV_FULL": 1,
            "S_READ": BWD_COMPUTE_WARPS * g, "P_FULL": BWD_COMPUTE_WARPS * g,
            "DS_FULL": BWD_COMPUTE_WARPS * g, "DQ_READ": BWD_REDUCE_WARPS * g,
            "SDS_FULL": BWD_COMPUTE_WARPS // g + (g - 1), "PEER_SDS": 1}
