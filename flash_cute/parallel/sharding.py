"""Shards for the parallel functions, by group: `shard` takes this rank's part of a full
tensor, `unshard` gathers every rank's part back into global order (an all-gather)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flash_cute.parallel import comm, layouts


def shard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1,
          mesh_dim=None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (the same on every rank) along `dim`, in
    `layout` over `group` (see `ring.ring_attention`)."""
    group = comm.resolve_group(group, mesh_dim)
    return layouts.shard(x, layout, dist.get_world_size(group), dist.get_rank(group), dim)


def unshard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1,
            mesh_dim=None) -> torch.Tensor:
    """The full tensor from every rank's shard `x` along `dim` (an all-gather; no
    gradient)."""
    group = comm.resolve_group(group, mesh_dim)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return layouts.unshard_parts(parts, layout, dim)
