"""Compile-time choices of the Hopper pipeline (no CuTe DSL import, so the registry can read it)."""

from typing import NamedTuple, Optional

# Warpgroups: one producer (TMA) and consumers that each own 64 query rows of a tile (WGMMA's
# M is 64 per warpgroup): two for the backward and a 128-row forward tile, three for a 192-row
# forward tile (`HopperFwd` derives its own from its tile).
BWD_CONSUMER_WARPGROUPS = 2
BWD_NUM_THREADS = 128 * (1 + BWD_CONSUMER_WARPGROUPS)
# setmaxnreg budgets (multiples of 8) by the number of consumer warpgroups, as FA3 and the
# CUTLASS Hopper FMHA use: every register the CTA gets at launch goes to a role. Two
# consumers: ptxas gives a 384-thread CTA 168 registers per thread (65536 / 384, rounded down
# to 8), and 128 * 24 + 256 * 240 = 384 * 168. Three: 512 threads at 128, and
# 128 * 32 + 384 * 160 = 512 * 128.
ROLE_REGISTERS = {2: (24, 240), 3: (32, 160)}
BWD_PRODUCER_REGISTERS, BWD_CONSUMER_REGISTERS = ROLE_REGISTERS[BWD_CONSUMER_WARPGROUPS]


class FwdSchedule(NamedTuple):
    """A forward kernel's compile-time schedule: its tile, K/V ring depth, the two FA3
    overlaps and the persistent tile scheduler (each switchable so that `inspect` and
    `bench/hopper_fwd_ablation.py` compare them; see `HopperFwd`)."""
    tile_m: int
    tile_n: int
    kv_stages: int
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # The plain-Python model (`flash_cute.models.schedule_makespan`, hdim 64-256, 512-16k
    # keys) puts the persistent grid's makespan (causal tiles folded into heavy/light pairs)
    # within 5 % of the hardware's own one-CTA-per-tile LPT schedule, mostly within 3 %; what
    # it saves per tile (the next tile's loads under the epilogue) is measured in
    # docs/perf.md. Off by default; `FWD_SCHEDULES` turns it on where it measured faster.
    persistent: bool = False


# hdim -> FwdSchedule. tile_m is 128 (two consumer warpgroups) or 192 (three); tile_n shrinks as the
# head dim grows so that Q + 2 stages of K and V stay inside the H200's 227 KiB of shared memory
# (hdim 256: 64 + 2 * 40 + 2 * 40 KiB = 224 KiB) and the O accumulator (hdim_v / 2 registers
# per thread), S (tile_n / 2) and, with the overlap, P (tile_n / 4) fit the 240-register
# consumer budget.
# Ping-pong is on where it measured faster on the H200 (docs/perf.md): hdim 64 +1 % (session 7);
# hdim 128, once the masked blocks got loops of their own, +0.8 to +7.1 % causal and −0.9 to
# +8.0 % non-causal (session 10; in session 7 it had cost 12 % causal); on, unmeasured, at 96
# and 192. Not at hdim 256: within +-2 % there (session 14), and without it O's rescale waits
# for the next S to be issued (FA4's order there): +2.6 to +3.3 % non-causal (session 16).
# Persistence is on where it measured faster (docs/perf.md, session 8, seqlen 2k and 8k):
# hdim 64 +1 to +7 % (one cell -3 %), hdim 128 0 to +5 %; unmeasured at 96, 192, 256.
# hdim 64 takes 192-row tiles (three consumer warpgroups at 160 registers, FA4's choice):
# +2 to +13 % over 128 rows (docs/perf.md, session 9). Not at hdim 96: its P and O do not fit
# 160 registers (ptxas spills and serializes the WGMMAs). Without persistence ptxas spills
# 408 B at 192 rows (118 TFLOP/s), so `HopperFwd` takes 192 rows persistent only.
FWD_SCHEDULES = {64: FwdSchedule(192, 128, 2, persistent=True), 96: FwdSchedule(128, 128, 2),
         128: FwdSchedule(128, 128, 2, persistent=True),
         192: FwdSchedule(128, 96, 2), 256: FwdSchedule(128, 80, 2, pingpong=False)}

def with_switches(schedule: FwdSchedule, **switches) -> FwdSchedule:
    """`schedule` with some `FwdSchedule` switches changed (for ablations and tests); a 192-row
    tile without persistence takes 128 rows (`HopperFwd` runs 192 rows persistent only)."""
    schedule = schedule._replace(**switches)
    if not schedule.persistent and schedule.tile_m > 128:
        return schedule._replace(tile_m=128)
    return schedule


# Packed GQA packs groups that divide 128 rows (every head dim has a 128-row schedule).
PACK_ROWS = 128


# Causal problems of at most this many query rows per head (times the packing) run shorter
# query tiles: the diagonal blocks are computed whole, so they are a larger share of a tall
# tile (at 512 rows 59 % of a 192-row tile's computed scores are kept, 80 % of a 128-row
# tile's). Forward, hdim 64: 128 rows instead of 192; H200, hopper_fwd_ablation --rounds 3
# (session 14), 128 against 192 rows, TFLOP/s: 225 / 192 at 512, 306 / 267 at 1k, 369 / 360
# at 2k; from 4k up 192 rows lead (403 / 422, 427 / 460, 440 / 472 at 4k, 8k, 16k), and
# without the mask at every length (2k-16k by 12-18 %).
SHORT_CAUSAL_ROWS = 2048
# ... and hdim 256 takes 64 key columns instead of 80 (a diagonal block computed whole is then
# 20 % smaller). H200, hopper_fwd_ablation --rounds 3 (session 17), 80 against 64 columns,
# causal, TFLOP/s: 281.9 / 298.8 at 512, 414.1 / 428.0 at 1k, 519.8 / 536.5 at 2k (607.0 /
# 619.1 at 4k, 646.9 / 658.5 at 8k, 685.9 / 678.5 at 16k); without the mask 80 columns lead
# (641.3 / 638.6 at 2k, 704.7 / 677.9 at 8k, 712.0 / 700.6 at 16k).
SHORT_CAUSAL_TILE_N = {256: 64}
# Backward, hdim 128: 64 rows instead of 80 (FA4's causal tile) up to this many. A key block
# of 128 then starts on a query-tile boundary; 80-row tiles straddle it, and at 512 rows that
# is a large part of each CTA's few tiles. 64 against 80 rows, TFLOP/s: 228.6 / 210.6 at 512
# (pipeline_bwd, session 13) and 228.0 / 211.4 (public API, session 14); at 1k 323.3 /
# 330.8, at 2k 411.8 / 408.1 and at 8k 512.4 / 536.2 (80 rows ahead from 1k up).
SHORT_CAUSAL_BWD_ROWS = 512


def short_causal(causal: bool, rows: int, keys: int, limit: int = SHORT_CAUSAL_ROWS) -> bool:
    """Whether a problem takes the short causal tiles: causal, with at most `limit` query
    rows (`rows`: the longest sequence's, times the packing) and keys. With many more keys
    than queries (the diagonal aligned bottom-right), most blocks are whole and the taller
    tile's lead at every length without the mask applies instead."""
    return causal and 0 < rows <= limit and keys <= limit


def fwd_schedule(hdim: int, pack: int = 1, rows_past_sequence: bool = False,
             short: bool = False) -> FwdSchedule:
    """The forward schedule of a head dim for a packing of `pack` heads per tile. A 192-row
    tile takes 128 rows instead where `pack` does not divide 192, or where packed O leaves by
    row stores (`rows_past_sequence`: varlen or seqused_q, see `o_smem_tile`): at 160
    registers ptxas then hoists the packed rows' addresses out of the main loop and spills
    them (64 to 176 B). `short` (`short_causal`): a 192-row tile takes 128 rows, and hdim
    256 `SHORT_CAUSAL_TILE_N` key columns."""
    schedule = FWD_SCHEDULES[hdim]
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

COMPILE_OPTIONS = "--opt-level 2"


def _align(b: int) -> int:
    return -(-b // 1024) * 1024


def _mainloop_smem_bytes(hdim: int, hdim_v: int, schedule: tuple) -> int:
    """The mbarriers (full + empty per stage of Q, K and V) padded to the 1 KiB alignment of
    the swizzled tiles, then Q and the K and V rings."""
    tile_m, tile_n, stages = schedule[:3]
    return _align(8 * (2 + 4 * stages)) + _align(tile_m * hdim * 2) \
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



# hdim -> BwdSchedule. FA3's shapes: 64 x 128 up to hdim 128 (dK + dV = hdim/2 + hdim_v/2
# registers per thread, S and dP 32 each); beyond, fewer keys so that dK/dV still fit and
# the rings, K, V, P, dS and the 64 KiB dQ tile stay inside 227 KiB (hdim 256 at 48 keys: Q
# 2 x 32, dO 32, K 24, V 24, P and dS 6 each, dQ 64 KiB; what fits is `bwd_smem_plan`'s).
# swap_sdp where it measured faster on the H200: hdim 64 +2-5 % (docs/perf.md, 2026-11-29);
# at hdim 96 it was 1-2 % slower (session 13), so P stays in shared memory there. hdim 128
# takes FA4's 80 query rows (swap_sdp, dQ transposed): +4-6 % over 64 rows non-causal at
# 2k-8k tokens; causal -8 % at 512, -1 % at 2k, +4 % at 8k (session 13; FA4 takes 64 rows
# for causal).
# hdim 64 takes 128 query rows (FA3's 128 x 128; swap_sdp with shuffled LSE₂/Δ): +4 to +7 %
# over 64 rows (docs/perf.md, session 9). hdim 256: one Q/dO stage at 64 keys freed the
# 64 KiB of the fp32 dQ tile (one bulk reduce-add per query tile instead of 64 fp32 atomics
# per thread: 1.6-2.0x the two-stage ring with atomics, docs/perf.md, session 11); FA4's 48
# keys with dK/dV transposed keep two Q stages beside it: 1.18-1.33x 64 x 64 x 1 (2k-16k,
# causal and not; session 14). At hdim 192 FA4's 96 keys with one dO stage: 1.06-1.11x
# 64 x 64 x 2. Two dO stages leave no room for the dQ tile there (dQ falls back to atomics:
# 0.5x). dq_per_wg at hdim 64 and 128: +1 to +4 % in all 8 cells (2k/8k, causal or not,
# 5 rounds; docs/perf.md, session 16); unmeasured at the other head dims.
BWD_SCHEDULES = {64: BwdSchedule(128, 128, 2, True, dq_per_wg=True), 96: BwdSchedule(64, 128, 2),
             128: BwdSchedule(80, 128, 2, True, dq_per_wg=True),
             192: BwdSchedule(64, 96, 2, False, True, 1),
             256: BwdSchedule(64, 48, 2, False, True, 1)}

def bwd_schedule(hdim: int, varlen: bool = False, short: bool = False) -> BwdSchedule:
    """The backward schedule of a head dim. Varlen below 128 query rows takes 64 rows with P in
    shared memory: it reads LSE₂ and Δ from global memory (`HopperBwd.stats_tma`), and with
    swap_sdp a thread's query columns of them (and their addresses) spill; at 128 rows they
    are shared by shuffles (`bwd.ShuffledRows`) and fit. `short` (`short_causal`): 80 rows
    take 64 (dQ then not transposed)."""
    schedule = BWD_SCHEDULES[hdim]
    if varlen and schedule.tile_m < 128:
        return schedule._replace(tile_m=64, swap_sdp=False)
    if short and schedule.tile_m == 80:
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
    (FA4's order) rather than while dV runs. At 128 query rows (hdim 64) it must for -O3:
    with the fp32 dP still to convert while dV reads the 16-bit P from registers, ptxas
    -O2/-O3 serializes the WGMMAs (C7512). At 80 rows (hdim 128) this order measured 5 %
    slower causal (docs/perf.md, session 15), so there dS is stored while dV runs."""
    return BwdSchedule(*schedule).tile_m >= 128


def bwd_compile_options(schedule: tuple) -> str:
    """ptxas's level for a backward schedule: -O3 (FA4's) where dS is stored before dV; with
    that order it measured 4-7 % faster than the other order at -O1 at hdim 64 (session 15).
    Elsewhere -O1: at 80 rows (hdim 128) the other order spills 40 B at -O3 and FA4's order
    at -O3 ran 2-3 % slower causal (session 15; 0.97-1.00x of -O1 on top of the stage-first
    descriptors, session 17); at 64 rows (hdim 256) -O3 measured even."""
    return "--opt-level 3" if ds_stored_before_dv(schedule) else "--opt-level 1"
