"""Shards for the parallel functions, by group: `shard` takes this rank's part of a full
tensor, `unshard` gathers every rank's part back into global order (an all-gather). Packed
documents (`cu_seqlens`) are sharded document by document (`layouts.varlen_rows`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flash_cute.parallel import comm, layouts


def shard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1,
          mesh_dim=None, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (the same on every rank) along `dim`, in
    `layout` over `group` (see `ring.ring_attention`).

    Args:
        x: the full tensor, the same on every rank.
        layout: "contiguous" (default), "striped" or "zigzag".
        group: a ProcessGroup or a DeviceMesh (default: the world).
        dim: the sequence dim (1 for [b, s, h, d]; 0 for packed [t, h, d]).
        mesh_dim: the DeviceMesh dim, when `group` is a mesh of more than one.
        cu_seqlens: packed documents' offsets along `dim` (int32 [docs + 1]): each
            document is sharded on its own.

    Returns:
        This rank's shard (a copy), on x's device.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: a length the layout cannot shard, an unknown layout, or a mesh without
            `mesh_dim`."""
    group = comm.resolve_group(group, mesh_dim)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = layouts.positions(x.shape[dim], layout, world, rank) if cu_seqlens is None else \
        layouts.varlen_rows(cu_seqlens, layout, world, rank)[0]
    return x.index_select(dim, rows.to(x.device))


def unshard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1,
            mesh_dim=None, cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard `x` along `dim` (an all-gather; no
    gradient).

    Args:
        x: this rank's shard.
        layout: the layout it was sharded in.
        group: a ProcessGroup or a DeviceMesh (default: the world).
        dim: the sequence dim.
        mesh_dim: the DeviceMesh dim, when `group` is a mesh of more than one.
        cu_seqlens: the packed documents' offsets along `dim` in the full tensor.

    Returns:
        The full tensor, on every rank.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: an unknown layout, or a mesh without `mesh_dim`."""
    group = comm.resolve_group(group, mesh_dim)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if cu_seqlens is None:
        return layouts.unshard_parts(parts, layout, dim)
    rows = torch.cat([layouts.varlen_rows(cu_seqlens, layout, world, r)[0]
                      for r in range(world)])
    full = torch.empty_like(torch.cat(parts, dim=dim))
    full.index_copy_(dim, rows.to(x.device), torch.cat(parts, dim=dim))
    return full
