"""Sequence layouts of a ring: which global positions each of `world` ranks holds.

* **contiguous**: rank r holds positions [r·L/w, (r+1)·L/w). Under a causal mask the last
  rank attends to every earlier position and the first to its own block only.
* **striped** (Striped Attention): position t goes to rank t mod w, so every rank holds a
  comb over the whole sequence and each ring step's block is close to a triangle.
* **zigzag** (Llama 3's head-tail pairing): the sequence is cut into 2w chunks and rank r
  holds chunks r and 2w − 1 − r, one from each end, so the causal work evens out.

Positions are global token indices: the masks, mods, dropout and sink of a sharded call see
them, so a sharded call computes what the unsharded one does.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "striped", "zigzag")


def shard_multiple(layout: str, world: int) -> int:
    """The multiple a sequence length must be of for `layout` over `world` ranks.

    Args:
        layout: "contiguous", "striped" or "zigzag".
        world: the number of ranks.

    Returns:
        world, or 2 · world for zigzag (each rank holds a head and a tail chunk).

    Raises:
        ValueError: an unknown layout, or a world that is not a positive int."""
    _check_layout(layout, world)
    return 2 * world if layout == "zigzag" else world


def positions(seqlen: int, layout: str, world: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` holds, in its local order (increasing).

    Args:
        seqlen: the full sequence's length.
        layout: "contiguous", "striped" or "zigzag".
        world: the number of ranks.
        rank: this rank, in [0, world).

    Returns:
        int64 [seqlen / world].

    Raises:
        ValueError: `seqlen` not a multiple of `shard_multiple`, a rank outside [0, world),
            or an unknown layout."""
    multiple = shard_multiple(layout, world)
    if seqlen % multiple:
        raise ValueError(f"a sequence of {seqlen} tokens does not shard over {world} ranks in "
                         f"the {layout} layout: its length must be a multiple of {multiple} "
                         f"(pad it to {-(-seqlen // multiple) * multiple})")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    local = seqlen // world
    if layout == "contiguous":
        return torch.arange(rank * local, (rank + 1) * local)
    if layout == "striped":
        return torch.arange(rank, seqlen, world)
    chunk = local // 2
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * world - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def shard(x: torch.Tensor, layout: str, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of `x` along its sequence dim `dim` (a copy)."""
    return x.index_select(dim, positions(x.shape[dim], layout, world, rank).to(x.device))


def unshard_parts(parts, layout: str, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard, in global order (one process, no
    collective: `unshard` gathers the parts).

    Args:
        parts: every rank's shard, `parts[r]` rank r's, all of one shape.
        layout: the layout they were sharded in.
        dim: their sequence dim.

    Returns:
        The full tensor, the parts' dtype and device.

    Raises:
        ValueError: an unknown layout."""
    world = len(parts)
    local = parts[0].shape[dim]
    seqlen = local * world
    full = torch.cat(list(parts), dim=dim)
    order = torch.cat([positions(seqlen, layout, world, r) for r in range(world)])
    # full's row i holds global position order[i]: invert the permutation.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seqlen)
    return full.index_select(dim, inverse.to(full.device))


def causal_work(seqlen: int, layout: str, world: int) -> list[float]:
    """Per rank, the causal score elements its queries compute over the whole sequence:
    pairs (q, k) with k < q count 1, the diagonal k = q counts 1/2 (the triangle's share of
    a diagonal block, as the kernels' diagonal tiles do about half the work). Exact, from the
    positions: rank r's work is the sum over its positions t of t + 1/2.

    Args:
        seqlen: the full sequence's length.
        layout: "contiguous", "striped" or "zigzag".
        world: the number of ranks.

    Returns:
        One float per rank.

    Raises:
        ValueError: as `positions`."""
    return [float((positions(seqlen, layout, world, r).double() + 0.5).sum())
            for r in range(world)]


def _check_layout(layout: str, world: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")


def varlen_rows(cu_seqlens, layout: str, world: int, rank: int):
    """Packed documents (global `cu_seqlens`, [docs + 1]) sharded document by document: each
    document is split over the ranks in `layout` as a sequence of its own would be (zigzag:
    every rank holds a head and a tail chunk of every document, so causal work balances per
    document). Returns int64 tensors (rows: the packed rows rank `rank` holds, in its local
    order; docs: each row's document; pos: each row's position inside its document).
    ValueError naming the document when a length is not a multiple of `shard_multiple`."""
    cu = [int(c) for c in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist")
                           else cu_seqlens)]
    multiple = shard_multiple(layout, world)
    rows, docs, pos = [], [], []
    for d, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if (end - start) % multiple:
            padded = -(-(end - start) // multiple) * multiple
            raise ValueError(f"document {d} has {end - start} tokens: in the {layout} layout "
                             f"over {world} ranks every document's length must be a multiple "
                             f"of {multiple} (pad it to {padded})")
        p = positions(end - start, layout, world, rank)
        rows.append(p + start)
        docs.append(torch.full_like(p, d))
        pos.append(p)
    empty = torch.zeros(0, dtype=torch.long)
    return tuple(torch.cat(t) if t else empty for t in (rows, docs, pos))
