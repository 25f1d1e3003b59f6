"""Block masks: which (query block, key block) tiles attention visits, and which of them are
fully visible, as torch's FlexAttention `BlockMask` holds them.

`create_block_mask` is torch's (`torch.nn.attention.flex_attention.create_block_mask`): a
BlockMask built there, or by hand (`BlockMask.from_kv_blocks`), is accepted as it is. Its
meaning, FlexAttention's, is what every implementation follows: a key is visible to a query
when their block is *full*, or when it is *partial* and the mask mod says so; a block listed
as neither is skipped. `block_states` reads a BlockMask into one int8 state per block (0
skipped, 1 partial, 2 full); `reblock` maps the states onto another tiling (a kernel's query
and key tiles, which need not be torch's 128 × 128): a tile is skipped when every block it
covers is, full when every one is full, partial otherwise — exact when the BlockMask agrees
with its mask mod, as `create_block_mask`'s does.
"""

import math
import weakref

import torch

from flash_cute.contract.constants import EMPTY, FULL, PARTIAL


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128):
    """torch's `create_block_mask` (FlexAttention's, with its arguments): the BlockMask of
    `mask_mod` over [B, H, Q_LEN, KV_LEN] (B or H None: one entry broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    return torch_create(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE)


def block_states(block_mask) -> torch.Tensor:
    """int8 [B, H, query blocks, key blocks]: EMPTY, PARTIAL or FULL per block."""
    if isinstance(block_mask, Fa4Blocks):
        return block_mask.states()
    partial_count, partial_index = block_mask.kv_num_blocks, block_mask.kv_indices
    b, h, n_q, n_k = partial_index.shape
    states = torch.zeros(b, h, n_q, n_k, dtype=torch.int8, device=partial_index.device)
    _mark(states, partial_count, partial_index, PARTIAL)
    if block_mask.full_kv_num_blocks is not None:
        _mark(states, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
    return states


def _mark(states, counts, indices, value) -> None:
    """states[b, h, m, indices[b, h, m, :counts[b, h, m]]] = value (the unlisted slots of
    `indices` go to a spare column, then dropped)."""
    n_k = states.shape[-1]
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
    idx = torch.where(listed, indices.long().clamp(0, n_k - 1), n_k)
    hit = torch.zeros(*states.shape[:-1], n_k + 1, dtype=torch.bool, device=states.device)
    hit.scatter_(-1, idx, True)
    states[hit[..., :n_k]] = value


def element_mask(states: torch.Tensor, block_size, seqlen_q: int, seqlen_k: int,
                 mod_mask) -> torch.Tensor:
    """bool [B, H, seqlen_q, seqlen_k]: visible keys under FlexAttention's rule, with
    `mod_mask` (bool, broadcastable to that shape) the mask mod's answer."""
    block_q, block_k = block_size
    per_element = (states.repeat_interleave(block_q, dim=2)[:, :, :seqlen_q]
                   .repeat_interleave(block_k, dim=3)[:, :, :, :seqlen_k])
    return (per_element == FULL) | ((per_element == PARTIAL) & mod_mask)


def reblock(states: torch.Tensor, block_size, tile, seqlen_q: int, seqlen_k: int):
    """The states of `tile` = (rows, cols) tiles from those of `block_size` blocks (see the
    module docstring), computed on blocks of the two sizes' common divisor."""
    fine = [math.gcd(b, t) for b, t in zip(block_size, tile)]
    counts = [-(-n // f) for n, f in zip((seqlen_q, seqlen_k), fine)]
    s = (states.repeat_interleave(block_size[0] // fine[0], dim=2)[:, :, :counts[0]]
         .repeat_interleave(block_size[1] // fine[1], dim=3)[:, :, :, :counts[1]])
    steps = [t // f for t, f in zip(tile, fine)]
    pads = [(-c) % st for c, st in zip(counts, steps)]
    hi = torch.nn.functional.pad(s, (0, pads[1], 0, pads[0]), value=EMPTY).float()
    lo = torch.nn.functional.pad(s, (0, pads[1], 0, pads[0]), value=FULL).float()
    b, h = s.shape[:2]
    most = torch.nn.functional.max_pool2d(hi.view(b * h, 1, *hi.shape[2:]), steps, steps)
    least = -torch.nn.functional.max_pool2d(-lo.view(b * h, 1, *lo.shape[2:]), steps, steps)
    out = torch.where(most == EMPTY, EMPTY, torch.where(least == FULL, FULL, PARTIAL))
    return out.view(b, h, *out.shape[2:]).to(torch.int8)


def kernel_tiles(states: torch.Tensor, block_size, tile, batch: int, heads: int,
                 seqlen_q: int, seqlen_k: int) -> tuple:
    """What a kernel with (rows, cols) tiles `tile` reads of a block mask: the state of each
    of its tiles, int32 [batch, heads, query tiles, key tiles] (`reblock`), and the tight
    range of non-empty tiles, int32 [..., 2] (start, end), per query tile (the forward's
    loop) and per key tile (the backward's): a kernel visits the range and treats an empty
    tile inside it as masked, so any block mask is exact and a contiguous one is visited
    exactly. The forward's ranges carry two more columns, the longest run of full tiles
    (full_start, full_end) inside (start, end), which the kernel runs with no state or mask
    code at all (`block_range.narrow`)."""
    tiles = reblock(states, block_size, tile, seqlen_q, seqlen_k).to(torch.int32)
    tiles = tiles.expand(batch, heads, *tiles.shape[2:]).contiguous()
    fwd = torch.cat([_ranges(tiles != EMPTY), _longest_run(tiles == FULL)], -1).contiguous()
    return tiles, fwd, _ranges((tiles != EMPTY).transpose(2, 3))


def _ranges(visible: torch.Tensor) -> torch.Tensor:
    """int32 [..., 2]: the first and one past the last True along the last dimension ((0, 0)
    where none is)."""
    count = visible.shape[-1]
    index = torch.arange(count, device=visible.device)
    start = torch.where(visible, index, count).amin(-1)
    end = torch.where(visible, index + 1, 0).amax(-1)
    return torch.stack([torch.minimum(start, end), end], -1).to(torch.int32).contiguous()


def _longest_run(full: torch.Tensor) -> torch.Tensor:
    """int32 [..., 2]: the first and one past the last True of the longest run of Trues along
    the last dimension (the first such run on a tie; (0, 0) where there is none)."""
    count = full.shape[-1]
    index = torch.arange(count, device=full.device)
    # A run's length at each of its elements: the distance past the last False before it.
    last_false = torch.where(full, -1, index).cummax(-1).values
    length = torch.where(full, index - last_false, 0)
    best = length.amax(-1)
    end = torch.where(best > 0, length.argmax(-1) + 1, 0)
    return torch.stack([end - best, end], -1).to(torch.int32)


class Fa4Blocks:
    """FA4's `BlockSparseTensorsTorch` read as a FlexAttention BlockMask is (`block_states`
    takes either): mask_block_cnt / _idx list each row's partial blocks, full_block_cnt / _idx
    its full ones (indices packed left; the index tensors may be narrower than the blocks, as
    FA4 allows), by query block for the forward's tensors and by key block for the
    backward's (`key_major`); the block size given or inferred. The kernels derive both
    directions from the states (`kernel_tiles`). It holds the tensors weakly: the caches keyed
    by it (`from_fa4`, the mods registry) go with them."""

    mask_mod = None

    def __init__(self, tensors, seqlen_q: int, seqlen_k: int, key_major: bool = False):
        count, index = tensors.mask_block_cnt, tensors.mask_block_idx
        if index.dim() != 4 or count.shape != index.shape[:3]:
            raise ValueError("block_sparse_tensors: mask_block_idx must be [b, h, blocks, "
                             "listed blocks] and mask_block_cnt its first three dims, got "
                             f"{tuple(index.shape)} and {tuple(count.shape)}")
        b, h, rows = index.shape[:3]
        lengths = (seqlen_k, seqlen_q) if key_major else (seqlen_q, seqlen_k)
        size = tensors.block_size
        if size is None:
            size = (_infer_block(lengths[0], rows), 128)
            size = size[::-1] if key_major else size
        self.BLOCK_SIZE = tuple(int(x) for x in size)
        along = self.BLOCK_SIZE[::-1] if key_major else self.BLOCK_SIZE
        if -(-lengths[0] // along[0]) != rows:
            raise ValueError(f"block_sparse_tensors: {rows} rows of blocks of {along[0]} do not "
                             f"cover {lengths[0]} {'keys' if key_major else 'queries'}")
        self.key_major = key_major
        self.blocks = (rows, -(-lengths[1] // along[1]))
        self.shape = (b, h, seqlen_q, seqlen_k)
        full = (tensors.full_block_cnt, tensors.full_block_idx)
        self._refs = tuple(None if t is None else weakref.ref(t) for t in (count, index) + full)

    def _get(self, i: int):
        ref = self._refs[i]
        return None if ref is None else ref()

    # A BlockMask's attribute (`interface._check_block_mask` looks for it).
    kv_indices = property(lambda self: self._get(1))

    def states(self) -> torch.Tensor:
        """int8 [B, H, query blocks, key blocks], as `block_states` gives a BlockMask's."""
        count, index, full_count, full_index = (self._get(i) for i in range(4))
        states = torch.zeros(*index.shape[:2], *self.blocks, dtype=torch.int8,
                             device=index.device)
        _mark(states, count, index, PARTIAL)
        if full_count is not None:
            _mark(states, full_count, full_index, FULL)
        return states.transpose(2, 3).contiguous() if self.key_major else states


def _infer_block(seqlen: int, blocks: int) -> int:
    """The block size of `blocks` blocks over `seqlen`: 128 (FA4's usual sm90 tile) where it
    fits, else another of FA4's tile sizes (pass block_size to be explicit)."""
    for size in (128, 192, 256, 176, 64, 80, 96, 112):
        if -(-seqlen // size) == blocks:
            return size
    raise ValueError(f"block_sparse_tensors: no block size gives {blocks} blocks over "
                     f"{seqlen}; pass block_size")


# id(mask_block_idx) -> (the tensors' identity, Fa4Blocks); an entry goes with its tensor.
_FA4_BLOCKS = {}


def from_fa4(tensors, seqlen_q: int, seqlen_k: int, key_major: bool = False) -> Fa4Blocks:
    """The `Fa4Blocks` of FA4's block-sparsity tensors, one per (mask_block_idx tensor, the
    other tensors, lengths) while that tensor lives, so that the mods registry and the plan
    cache keep their entries across calls."""
    if not all(hasattr(tensors, name) for name in ("mask_block_cnt", "mask_block_idx",
                                                     "full_block_cnt", "full_block_idx",
                                                     "block_size")):
        raise TypeError("block_sparse_tensors must be FA4's BlockSparseTensorsTorch (or fields "
                        f"of its names), got {type(tensors).__name__}")
    key = id(tensors.mask_block_idx)
    ident = (tuple(id(getattr(tensors, name)) for name in ("mask_block_cnt", "mask_block_idx",
                                                           "full_block_cnt", "full_block_idx")),
             tensors.block_size, seqlen_q, seqlen_k, key_major)
    held = _FA4_BLOCKS.get(key)
    if held is None or held[0] != ident:
        if held is None:
            weakref.finalize(tensors.mask_block_idx, _FA4_BLOCKS.pop, key, None)
        held = (ident, Fa4Blocks(tensors, seqlen_q, seqlen_k, key_major))
        _FA4_BLOCKS[key] = held
    return held[1]
