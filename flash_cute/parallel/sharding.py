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
    `layout` over `group` (see `ring.ring_attention`). Packed documents: `cu_seqlens`, the
    documents' offsets along `dim` (pass dim=0 for [t, h, d])."""
    group = comm.resolve_group(group, mesh_dim)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = layouts.positions(x.shape[dim], layout, world, rank) if cu_seqlens is None else \
        layouts.varlen_rows(cu_seqlens, layout, world, rank)[0]
    return x.index_select(dim, rows.to(x.device))


def unshard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1,
            mesh_dim=None, cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard `x` along `dim` (an all-gather; no
    gradient)."""
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
