"""Split-KV (Flash-Decoding): how many key splits a forward runs, and how long each is.

With few query tiles (decode: one query row, or a few, per head) a forward has fewer tiles
than the GPU has SMs, and each tile streams its whole K/V alone. Splitting every tile's keys
into `count` parts fills the SMs; each part writes an fp32 partial O and its LSE, and
`flash_cute.blocks.lse_merge` merges them. Host-side and arch-neutral (no CuTe DSL): each arch's
`plan_forward` calls `plan_splits` with its tile and how many CTAs an SM holds.

`num_splits` keeps FA4's meaning: 1 no split, 0 the heuristic, n > 1 n splits.
``seqlen_k_per_split`` (FA4's) fixes each split's length in keys, a multiple of the kernel's
tile_n: split s then covers keys ``[s * len, (s + 1) * len)`` of every sequence, so a
sequence's result depends on nothing but its own inputs (bitwise reproducible whatever the
batch composition or the split count; `block_range.split_range`).
"""

from typing import NamedTuple, Optional

from flash_cute.contract.block_range import block_range

# Splits the heuristic picks at most (FA2/FA3's bound); an explicit num_splits may go up to
# validation's MAX_NUM_SPLITS (the merge loops over any count).
MAX_SPLITS = 128
# The cost model's constants, in units of one K/V block's time on one SM (docs/decisions.md,
# D-SPLIT): every split pays the tile's prologue and epilogue (Q's load, the first K/V
# block's latency, the partial's store), and a split launch pays the merge (the merge kernel
# on ampere, the last split's merge of each tile on hopper: D-SPLIT-MERGE).
SPLIT_OVERHEAD_BLOCKS = 2
MERGE_BLOCKS = 2


class Splits(NamedTuple):
    """A split-KV launch: `count` > 1 splits; `blocks_per_split` 0 cuts each tile's visited
    blocks evenly, > 0 fixes each split to that many blocks from key 0."""
    count: int
    blocks_per_split: int = 0


def visited_blocks(problem, tile_m: int, tile_n: int, pack: int = 1) -> int:
    """K/V blocks the longest query tile of the longest sequence visits."""
    rows = problem.max_seqlen_q * pack
    last = max(-(-rows // tile_m) - 1, 0)
    rng = block_range(last, tile_m, tile_n, problem.max_seqlen_q, problem.max_seqlen_k,
                      problem.causal, problem.window_left, problem.window_right, pack)
    return max(rng.n_block_max - rng.n_block_min, 0)


def launch_tiles(problem, tile_m: int, pack: int = 1) -> int:
    """Query tiles of a forward launch: those of the longest sequence (times the packing),
    per K/V head group (packed) or query head, per batch entry."""
    return (-(-problem.max_seqlen_q * pack // tile_m) * (problem.nheads // pack)
            * problem.batch)


def num_splits_heuristic(tiles: int, blocks: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """The split count that minimizes the modelled time: waves of CTAs times each CTA's work,
    ``ceil(tiles * s / (num_sms * ctas_per_sm)) * (ceil(blocks / s) + SPLIT_OVERHEAD_BLOCKS)``,
    plus `MERGE_BLOCKS` for any s > 1; ties go to fewer splits. `tiles`: query tiles of the
    launch (tiles x heads x batch); `blocks`: K/V blocks per tile."""
    if tiles <= 0 or blocks <= 1:
        return 1
    slots = num_sms * ctas_per_sm
    best, best_cost = 1, None
    for s in range(1, min(MAX_SPLITS, blocks) + 1):
        waves = -(-tiles * s // slots)
        cost = waves * (-(-blocks // s) + SPLIT_OVERHEAD_BLOCKS) + (MERGE_BLOCKS if s > 1 else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def plan_splits(problem, tile_m: int, tile_n: int, pack: int, num_sms: int,
                ctas_per_sm: int = 1) -> Optional[Splits]:
    """The `Splits` of a forward (None: unsplit) from the problem's `num_splits` and
    `seqlen_k_per_split` (validated), the kernel's tile, its head packing and the GPU."""
    if getattr(problem, "partial_out", False):
        return Splits(1)   # one split: its float32 partial is the call's result
    requested, per_split = problem.num_splits, problem.seqlen_k_per_split
    if requested == 1:
        return None
    blocks_per_split = 0
    needed = 1
    if per_split is not None:
        if per_split % tile_n:
            raise ValueError(f"seqlen_k_per_split={per_split} must be a multiple of this "
                             f"kernel's tile_n={tile_n} (hdim {problem.hdim})")
        blocks_per_split = per_split // tile_n
        needed = max(-(-problem.max_seqlen_k // per_split), 1)
    if requested > 1:
        if requested < needed:
            raise ValueError(f"seqlen_k_per_split={per_split} needs num_splits >= {needed} for "
                             f"max_seqlen_k={problem.max_seqlen_k}, got {requested}")
        count = requested
    else:
        tiles = launch_tiles(problem, tile_m, pack)
        blocks = visited_blocks(problem, tile_m, tile_n, pack)
        count = max(num_splits_heuristic(tiles, blocks, num_sms, ctas_per_sm), needed)
    return Splits(count, blocks_per_split) if count > 1 else None
