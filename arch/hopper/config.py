"""Compile-time choices of the Hopper pipeline (no CuTe DSL import, so the registry can read it)."""

from typing import NamedTuple, Optional

# Warpgroups: one producer (TMA) and consumers that each own 64 query rows of a tile (WGMMA's
# M is 64 per warpgroup): two for the backward and a 128-row forward tile, three for a 192-row
# forward tile, one for the 64-row decode schedule (`HopperFwd` derives its own from its tile).
BWD_CONSUMER_WARPGROUPS = 2
BWD_NUM_THREADS = 128 * (1 + BWD_CONSUMER_WARPGROUPS)
# setmaxnreg budgets by the number of consumer warpgroups: every register the CTA gets at
# launch goes to a role (docs/decisions.md, D-HF-ROLES).
ROLE_REGISTERS = {1: (24, 232), 2: (24, 240), 3: (32, 160)}
# CTAs per SM by the number of consumer warpgroups: a 64-row tile (one consumer warpgroup, a
# decode schedule: `bench/decode_ablation.py`'s `cta2`) launches two per SM, at 128 registers
# a thread and half the shared memory each (`CTA_PAIR_SMEM`), so one CTA's prologue and
# epilogue overlap the other's loads; the split heuristic counts them (`splits.plan_splits`).
CTAS_PER_SM = {1: 2}
CTA_PAIR_SMEM = 228 * 1024 // 2 - 1024
# Paged K/V: the producer also holds a block's page indices, read one block ahead
# (`paged.PagedBlocks.load_all`); 8 registers move to it from each consumer thread.
PAGED_ROLE_REGISTERS = {2: (40, 232)}
BWD_PRODUCER_REGISTERS, BWD_CONSUMER_REGISTERS = ROLE_REGISTERS[BWD_CONSUMER_WARPGROUPS]
REGISTER_FILE = 65536


def check_role_registers(producer: int, consumer: int, consumer_wgs: int,
                         ctas_per_sm: int = 1):
    """setmaxnreg only moves registers within the CTA's pool: the launch's registers a thread
    (the register file over the SM's threads, in steps of 8) times its threads. Budgets past
    it leave the consumers' increase waiting forever, a hang no compiler reports."""
    threads = 128 * (1 + consumer_wgs)
    launch = REGISTER_FILE // (ctas_per_sm * threads) // 8 * 8
    if producer + consumer * consumer_wgs > launch * (1 + consumer_wgs):
        raise ValueError(f"setmaxnreg budgets {producer} + {consumer_wgs} x {consumer} exceed "
                         f"the CTA's {1 + consumer_wgs} x {launch} registers a thread")


class FwdSchedule(NamedTuple):
    """A forward kernel's compile-time schedule: its tile, K/V ring depth, the two FA3
    overlaps and the persistent tile scheduler (each switchable so that `inspect` and
    `bench/hopper_fwd_ablation.py` compare them; see `HopperFwd`)."""
    tile_m: int
    tile_n: int
    kv_stages: int
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # Off unless `FWD_SCHEDULES` turns it on where it measured faster (D-HF-PERS).
    persistent: bool = False


# hdim -> FwdSchedule. tile_n shrinks as the head dim grows so that Q and two K/V stages fit
# shared memory and O, S and P the consumers' registers (D-HF-TILE); hdim 64 takes 192 rows
# (D-HF-192, persistent only: D-HF-192P); ping-pong (D-HF-PP) and persistence (D-HF-PERS)
# where they measured faster.
FWD_SCHEDULES = {64: FwdSchedule(192, 128, 2, persistent=True), 96: FwdSchedule(128, 128, 2),
                 128: FwdSchedule(128, 128, 2, persistent=True),
                 192: FwdSchedule(128, 96, 2), 256: FwdSchedule(128, 80, 2, pingpong=False)}


# The decode schedule (`fwd_schedule(decode=True)`, D-DECODE-PAIR): 64 rows for a few packed
# query rows, one consumer warpgroup, 64-key blocks in two stages, two CTAs per SM
# (`CTAS_PER_SM`).
DECODE_PAIR = FwdSchedule(64, 64, 2, intra_wg_overlap=True, pingpong=False, persistent=False)


def with_switches(schedule: FwdSchedule, **switches) -> FwdSchedule:
    """`schedule` with some `FwdSchedule` switches changed (for ablations and tests); a 192-row
    tile without persistence takes 128 rows (`HopperFwd` runs 192 rows persistent only)."""
    schedule = schedule._replace(**switches)
    if not schedule.persistent and schedule.tile_m > 128:
        return schedule._replace(tile_m=128)
    return schedule


# Paged K/V: a TMA box covers whole 128-byte swizzle atoms of the K and V tiles (8 rows), so
# pages of fewer rows are gathered before the kernel (`paged.page_chunk`).
MIN_PAGE_ROWS = 8

# Packed GQA packs groups that divide 128 rows (every head dim has a 128-row schedule).
PACK_ROWS = 128


# Causal problems of at most this many query rows per head (times the packing) run shorter
# query tiles, since the diagonal blocks are computed whole: 128 rows at hdim 64 (D-HF-SHORT)
# and 64 key columns at hdim 256 (D-HF-SHORTN) in the forward; 64 rows at hdim 128 up to
# `SHORT_CAUSAL_BWD_ROWS` in the backward (D-HB-SHORT).
SHORT_CAUSAL_ROWS = 2048
SHORT_CAUSAL_TILE_N = {256: 64}
SHORT_CAUSAL_BWD_ROWS = 512


def short_causal(causal: bool, rows: int, keys: int, limit: int = SHORT_CAUSAL_ROWS) -> bool:
    """Whether a problem takes the short causal tiles: causal, with at most `limit` query
    rows (`rows`: the longest sequence's, times the packing) and keys. With many more keys
    than queries (the diagonal aligned bottom-right), most blocks are whole and the taller
    tile's lead at every length without the mask applies instead."""
    return causal and 0 < rows <= limit and keys <= limit


def fwd_schedule(hdim: int, pack: int = 1, rows_past_sequence: bool = False,
                 short: bool = False, dropout: bool = False,
                 decode: bool = False) -> FwdSchedule:
    """The forward schedule of a head dim for a packing of `pack` heads per tile. A 192-row
    tile takes 128 rows instead where `pack` does not divide 192, or where packed O leaves by
    row stores (`rows_past_sequence`: varlen or seqused_q, see `o_smem_tile`): at 160
    registers ptxas then spills the packed rows' addresses (D-HF-PACK). `short`
    (`short_causal`): a 192-row tile takes 128 rows, and hdim
    256 `SHORT_CAUSAL_TILE_N` key columns. `dropout`: a 192-row tile takes 128 rows (at 160
    registers the Philox rounds spill). `decode` (the planner's `takes_decode_pair`):
    `DECODE_PAIR`."""
    if decode:
        return DECODE_PAIR
    schedule = FWD_SCHEDULES[hdim]
    if dropout and schedule.tile_m > 128:
        schedule = schedule._replace(tile_m=128)
    if pack > 1 and schedule.tile_m > PACK_ROWS and (schedule.tile_m % pack
                                                      or rows_past_sequence):
        return schedule._replace(tile_m=PACK_ROWS)
    if short:
        return schedule._replace(tile_m=min(schedule.tile_m, 128),
                                 tile_n=SHORT_CAUSAL_TILE_N.get(hdim, schedule.tile_n))
    return schedule


# (hdim, hdim_v) pairs with a kernel: equal dims, and 192/128 (DeepSeek's shape).
SUPPORTED_HDIMS = frozenset({(d, d) for d in FWD_SCHEDULES} | {(192, 128)})

SMEM_CAPACITY = 227 * 1024

COMPILE_OPTIONS = "--opt-level 2"  # D-HF-OPT


def _align(b: int) -> int:
    return -(-b // 1024) * 1024


def _mainloop_smem_bytes(hdim: int, hdim_v: int, schedule: tuple) -> int:
    """The mbarriers (full + empty per stage of Q, K and V) and split-KV's merge flag (an
    int32), padded to the 1 KiB alignment of the swizzled tiles, then Q and the K and V rings."""
    tile_m, tile_n, stages = schedule[:3]
    return _align(8 * (2 + 4 * stages) + 4) + _align(tile_m * hdim * 2) \
        + _align(stages * tile_n * hdim * 2) + _align(stages * tile_n * hdim_v * 2)


def o_smem_tile(hdim: int, hdim_v: int, schedule: tuple, rows_past_sequence: bool) -> str:
    """Where the forward's epilogue stages O for its TMA store: "own" (a tile of its own),
    "q" (Q's tile, when an own one does not fit: hdim 192 and 256; hdim_v <= hdim, so O fits)
    or "none" (`rows_past_sequence`, varlen or seqused_q: O goes from registers to global
    memory with row predicates, since the rows of a tile past its sequence are the next
    sequence's or padding that stays 0, which a TMA store would overwrite)."""
    if rows_past_sequence:
        return "none"
    own = _mainloop_smem_bytes(hdim, hdim_v, schedule) + _align(schedule[0] * hdim_v * 2)
    return "own" if own <= SMEM_CAPACITY else "q"


def smem_bytes(hdim: int, hdim_v: int, schedule: tuple, rows_past_sequence: bool = False) -> int:
    """Dynamic shared memory of one forward CTA, laid out as `HopperFwd`'s SharedStorage: the
    main loop's barriers and tiles, then O's tile where it has one of its own."""
    own_o = o_smem_tile(hdim, hdim_v, schedule, rows_past_sequence) == "own"
    return (_mainloop_smem_bytes(hdim, hdim_v, schedule)
            + own_o * _align(schedule[0] * hdim_v * 2))


# ---------------------------------------------------------------- FP8 forward

# hdim -> the FP8 forward's schedule. FP8 WGMMA takes K = 32, so tile_n is a multiple of 32; a
# K/V tile must not straddle the 128-token block of a block scale, so with block scales it
# also divides 128 (D-FP8-TILE); 128-row
# tiles (two consumer warpgroups). hdim 256 takes 64 keys so that Q, two stages each of K, V
# and its transpose, and O's own tile fit.
FP8_SCHEDULES = {64: FwdSchedule(128, 128, 2), 128: FwdSchedule(128, 128, 2),
                 192: FwdSchedule(128, 128, 2), 256: FwdSchedule(128, 64, 2, pingpong=False)}
FP8_SUPPORTED_HDIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
# Producer warps 1..3 transpose V (their loop holds four words, their transposes and two
# addresses), so 16 registers a thread move to the producer warpgroup from each consumer's.
FP8_ROLE_REGISTERS = (40, 232)


def fp8_o_tile(hdim: int, hdim_v: int, schedule: tuple, rows_past_sequence: bool,
               persistent: bool, out_bytes: int = 2) -> str:
    """Where the FP8 forward stages O for its TMA store (`o_smem_tile`'s choices, with "vt",
    the Vᵀ ring, in place of Q's tile, which is half O's size): "none", "own", or "vt" where
    an own tile does not fit (not persistent: the ring must be idle after the last block)."""
    if rows_past_sequence:
        return "none"
    tile_m, tile_n, stages = schedule[:3]
    if fp8_smem_bytes(hdim, hdim_v, schedule, True, out_bytes) <= SMEM_CAPACITY:
        return "own"
    if persistent or tile_n * stages < tile_m * out_bytes:
        raise ValueError(f"FP8 schedule {tuple(schedule)}: O's tile fits neither on its own "
                         f"nor in the Vᵀ ring")
    return "vt"


def fp8_smem_bytes(hdim: int, hdim_v: int, schedule: tuple, own_o: bool,
                   out_bytes: int = 2) -> int:
    """Dynamic shared memory of one FP8 forward CTA, laid out as `HopperFwdFp8`'s
    SharedStorage: full and empty barriers of Q, K, V and V's transpose (and split-KV's merge
    flag), then Q, the K ring, the V ring as loaded, its transpose, and O's tile where it has
    one of its own."""
    tile_m, tile_n, stages = schedule[:3]
    return (_align(8 * (2 + 6 * stages) + 4) + _align(tile_m * hdim)
            + _align(stages * tile_n * hdim) + 2 * _align(stages * tile_n * hdim_v)
            + own_o * _align(tile_m * hdim_v * out_bytes))


# ---------------------------------------------------------------- backward

class BwdSchedule(NamedTuple):
    """A backward kernel's compile-time schedule: the CTA owns tile_n keys (dK and dV stay in
    the consumers' registers for the whole query loop) and streams tile_m query rows at a time
    through a q_stages ring of Q (with LSE₂) and a do_stages ring of dO (with Δ; None: as
    many as Q's).

    swap_sdp (FA3's SdP_swapAB): S and dP are computed transposed (Sᵀ = K Qᵀ, keys on WGMMA's
    M), so each consumer warpgroup holds Pᵀ and dSᵀ of its own 64 keys in the layout of the A
    operand of dV += Pᵀ dO and dK += dSᵀ Q: those two GEMMs take A from registers and P never
    goes through shared memory. Needs tile_n = 128 (64 keys per warpgroup).

    swap_dkv (FA3's dKV_swapAB): dK and dV are computed transposed (dVᵀ = dOᵀ P, dKᵀ = Qᵀ dS:
    the head dim on WGMMA's M), so tile_n only needs to be a multiple of 16 (FA4's 48 keys
    at hdim 256, which leaves room for two Q stages beside the dQ tile). P and dS go through
    shared memory (not with swap_sdp).

    dq_per_wg (FA4's dQ protocol): each consumer warpgroup hands its half of the shared dQ tile
    to the dQ writer on a full/empty barrier pair of its own, and the writer adds the halves
    separately, so the warpgroups do not meet there; without it all 256 consumer threads and
    the writer meet at one barrier per query tile (one bulk add). Needs the dQ tile."""
    tile_m: int
    tile_n: int
    q_stages: int
    swap_sdp: bool = False
    swap_dkv: bool = False
    do_stages: Optional[int] = None
    dq_per_wg: bool = False



# hdim -> BwdSchedule: FA3's 128 keys up to hdim 128, fewer beyond so dK/dV, the rings and
# the dQ tile fit (D-HB-TILE); swap_sdp at hdim 64 and 128 (D-HB-SWAP); 128 query rows at hdim
# 64 (D-HB-128), FA4's 80 at 128 (D-HB-80); FA4's transposed dK/dV at 192 and 256 (D-HB-192,
# D-HB-256); dq_per_wg at 64 and 128 (D-HB-DQWG).
BWD_SCHEDULES = {64: BwdSchedule(128, 128, 2, True, dq_per_wg=True),
                 96: BwdSchedule(64, 128, 2),
                 128: BwdSchedule(80, 128, 2, True, dq_per_wg=True),
                 192: BwdSchedule(64, 96, 2, False, True, 1),
                 256: BwdSchedule(64, 48, 2, False, True, 1)}


def bwd_schedule(hdim: int, varlen: bool = False, short: bool = False,
                 dropout: bool = False, mods: bool = False) -> BwdSchedule:
    """The backward schedule of a head dim. Varlen below 128 query rows takes 64 rows with P in
    shared memory (D-HB-VARLEN; at 128 rows the statistics are shared by shuffles,
    `bwd.ShuffledRows`, and fit). `short` (`short_causal`): 80 rows take 64 (dQ then not
    transposed); so does `dropout` (at 80 rows the Philox rounds spill, D-DROPOUT). `mods`:
    64 rows at every head dim (a traced mod's per-element code spills at 80 and 128 rows,
    D-MODS-KERNEL)."""
    schedule = BWD_SCHEDULES[hdim]
    if varlen and schedule.tile_m < 128:
        return schedule._replace(tile_m=64, swap_sdp=False)
    if mods and schedule.tile_m > 64:
        return schedule._replace(tile_m=64)
    if (short or dropout) and schedule.tile_m == 80:
        return schedule._replace(tile_m=64)
    return schedule


BWD_SUPPORTED_HDIMS = frozenset({(d, d) for d in BWD_SCHEDULES} | {(192, 128)})


def dq_swapped(schedule: tuple) -> bool:
    """Whether dQ is computed transposed, dQᵀ = Kᵀ dSᵀ (FA3/FA4's dQ_swapAB): where tile_m is
    no multiple of WGMMA's 64-row M (80 query rows), so hdim takes M (64 per warpgroup; hdim
    128 only) and the queries N."""
    return BwdSchedule(*schedule).tile_m % 64 != 0


def bwd_mma_splits(schedule: tuple, hdim: int) -> dict:
    """How the two consumer warpgroups split each GEMM's (M, N) (WGMMA's M is 64 per
    warpgroup): S/dP (tile_m x tile_n) split N, as tile_m is then 64; dQ (tile_m x hdim) N
    at 64 query rows, M at 128; dK/dV (tile_n x hdim) split M when tile_n is 128, else N.
    With swap_sdp, Sᵀ/dPᵀ (tile_n x tile_m) split M: each warpgroup's keys are then its dK/dV
    rows. At 80 query rows (FA4's hdim-128 tile) dQᵀ (hdim x tile_m) splits M, its head dim.
    With swap_dkv, dKᵀ/dVᵀ (hdim x tile_n) split M where the head dim is a multiple of 128
    (`hdim`), else N (the keys)."""
    s = BwdSchedule(*schedule)
    if s.swap_dkv:
        if s.tile_m != 64 or s.tile_n % 16 or s.swap_sdp:
            raise ValueError(f"swap_dkv needs 64 query rows, tile_n a multiple of 16 and no "
                             f"swap_sdp, got {s}")
        dkv = (2, 1) if hdim % 128 == 0 else (1, 2)
        if dkv == (1, 2) and s.tile_n % 32:
            raise ValueError(f"swap_dkv split over the keys needs tile_n % 32 == 0, got {s}")
        return {"sdp": (1, 2), "dq": (1, 2), "dkv": dkv}
    if (s.tile_m, s.tile_n) not in ((64, 64), (64, 128), (80, 128), (128, 128)):
        raise ValueError(f"backward tile must be 64 x (64 | 128), 80 x 128 or 128 x 128, got "
                         f"{s.tile_m} x {s.tile_n}")
    if s.swap_sdp and s.tile_n != 128:
        raise ValueError("swap_sdp needs tile_n = 128 (64 keys per consumer warpgroup)")
    if s.tile_m in (80, 128) and not s.swap_sdp:
        raise ValueError(f"a {s.tile_m}-row query tile needs swap_sdp (S and P would not fit "
                         "240 registers beside dK and dV, or WGMMA's M)")
    if do_stages(s) != s.q_stages:
        raise ValueError(f"separate Q and dO stage counts need swap_dkv, got {s}")
    dkv = (2, 1) if s.tile_n == 128 else (1, 2)
    # 128 query rows: dQ splits its rows, 64 per warpgroup, like the forward's O; dQᵀ its
    # head dim.
    dq = (2, 1) if s.tile_m == 128 or dq_swapped(s) else (1, 2)
    return {"sdp": (2, 1) if s.swap_sdp else (1, 2), "dq": dq, "dkv": dkv}


def do_stages(schedule: tuple) -> int:
    """The dO ring's stages: the schedule's `do_stages`, or Q's where that is None."""
    s = BwdSchedule(*schedule)
    return s.q_stages if s.do_stages is None else s.do_stages


def stats_stage_rows(tile_m: int) -> int:
    """Floats per stage of the backward's LSE₂ and Δ rings: tile_m, rounded up to 32 so that
    every stage starts 128-byte aligned, as a TMA destination must (80 rows: 96)."""
    return -(-tile_m // 32) * 32


class BwdSmemPlan(NamedTuple):
    """What the backward keeps in shared memory besides Q, dO, K and V.

    pds_stages: P and dS tiles (1, or q_stages: then tile m uses stage m's index, and a warpgroup
    writing P of tile m+1 cannot overwrite what the other is still reading for tile m); with
    swap_sdp there is no P tile.
    dq_tma: a tile_m x hdim fp32 dQ tile, added to dQaccum by a bulk reduce-add; without it
    the consumers add dQ with fp32 atomics (hdim 256 with two Q/dO stages: 64 KiB more does
    not fit)."""
    pds_stages: int
    dq_tma: bool
    smem_bytes: int


def bwd_smem_plan(hdim: int, hdim_v: int, schedule: tuple) -> BwdSmemPlan:
    """The largest layout that fits SMEM_CAPACITY: the dQ tile first (it replaces hdim / 4
    fp32 atomics per consumer thread and query tile by one TMA), then double-buffered P and dS
    (one barrier less per query tile; only where Q and dO have as many stages). Sizes follow
    `HopperBwd`'s SharedStorage: mbarriers (K/V once, full + empty per stage of Q and dO)
    with the LSE₂ and Δ rings, then the Q and dO rings, K, V, P and dS, the dQ tile, each
    1 KiB aligned."""
    s = BwdSchedule(*schedule)
    tile_m, tile_n, q_stages, do_count = s.tile_m, s.tile_n, s.q_stages, do_stages(s)
    align = lambda b, to=1024: -(-b // to) * to  # noqa: E731
    # The barriers, then the LSE₂ and Δ rings (fp32, 128-byte aligned for their TMA).
    rows = stats_stage_rows(tile_m) * 4
    head = align(align(8 * (2 + 2 * q_stages + 2 * do_count), 128)
                 + align(q_stages * rows, 128) + align(do_count * rows, 128))
    base = (head + align(q_stages * tile_m * hdim * 2)
            + align(do_count * tile_m * hdim_v * 2) + align(tile_n * hdim * 2)
            + align(tile_n * hdim_v * 2))
    pds, dq = align(tile_m * tile_n * 2), align(tile_m * hdim * 4)
    tiles = 1 if s.swap_sdp else 2
    pds_stages = (q_stages, 1) if q_stages == do_count else (1,)
    plans = [BwdSmemPlan(p, d, base + tiles * p * pds + d * dq)
             for d in (True, False) for p in pds_stages]
    return next(p for p in plans if p.smem_bytes <= SMEM_CAPACITY)


def ds_stored_before_dv(schedule: tuple) -> bool:
    """Whether a consumer converts dS and stores it to shared memory before it issues dV
    (FA4's order) rather than while dV runs: at 128 query rows, so that ptxas does not
    serialize the WGMMAs; not at 80 rows, where it measured slower (D-HB-ORDER)."""
    return BwdSchedule(*schedule).tile_m >= 128


def bwd_compile_options(schedule: tuple) -> str:
    """ptxas's level for a backward schedule: -O3 (FA4's) where dS is stored before dV, else
    -O1 (D-HB-OPT)."""
    return "--opt-level 3" if ds_stored_before_dv(schedule) else "--opt-level 1"
