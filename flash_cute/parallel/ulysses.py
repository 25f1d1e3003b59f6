"""DeepSpeed-Ulysses: swap the sequence shard for a head shard with an all-to-all, attend
over the whole sequence with 1/w of the heads, and swap back. Its degree w must divide the
K/V heads (each rank needs whole K/V heads). And the hybrid: Ulysses inside the groups of
one mesh dim, the ring across the other (`hybrid_attention`).

The all-to-alls are torch.distributed's differentiable ones
(`torch.distributed.nn.functional.all_to_all_single`); the local attention is a
`flash_cute.parallel.local` implementation at the gathered sequence's global positions.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from flash_cute.api.params import document
from flash_cute.parallel import comm, layouts
from flash_cute.parallel.local import LocalAttention, spec_of
from flash_cute.parallel.ring import (
    CP_ARGS,
    CP_RAISES,
    CP_RETURNS,
    Shards,
    _RingAttention,
    concat_rows,
    default_local,
    dropout_refusal,
    header,
    local_refusal,
    with_dropout,
)


def _seq_to_heads(x, group, world: int):
    """[b, s_local, h, d] sequence-sharded -> [b, world · s_local, h / world, d]: this rank's
    heads over the ranks' shards, in rank order."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()
    send = comm.to_host(send, group)
    got = all_to_all_single(torch.empty_like(send), send, group=group).to(x.device)
    return got.permute(2, 0, 1, 3, 4).reshape(b, world * s, h // world, d)


def _heads_to_seq(x, group, world: int):
    """The inverse of `_seq_to_heads`: [b, world · s_local, h / world, d] -> [b, s_local, h,
    d]."""
    b, total, hw, d = x.shape
    s = total // world
    send = comm.to_host(x.reshape(b, world, s, hw, d).permute(1, 2, 0, 3, 4).contiguous(),
                        group)
    got = all_to_all_single(torch.empty_like(send), send, group=group).to(x.device)
    return got.permute(2, 1, 0, 3, 4).reshape(b, s, world * hw, d)


def _lse_to_seq(lse, group, world: int):
    """LSE [b, h / world, world · s_local] -> [b, h, s_local]."""
    out = _heads_to_seq(lse.transpose(1, 2)[..., None], group, world)
    return out[..., 0].transpose(1, 2)


def ulysses_refusal(q, k, v, layout: str, world: int):
    """This rank's reason to refuse a Ulysses call of degree `world`, or None."""
    error = local_refusal(q, k, v, layout, world)
    if error is None and (k.shape[2] < world or k.shape[2] % world):
        error = (f"a Ulysses degree of {world} needs the K/V heads ({k.shape[2]}) to be a "
                 f"multiple of it: each rank takes whole K/V heads (use the ring, or the "
                 f"hybrid with a Ulysses degree dividing {k.shape[2]})")
    return error


def _ulysses(q, k, v, group, world: int, rank: int, positions, spec, sink, local):
    """The all-to-all, the local attention at `positions` (the gathered sequence's), the
    sink on this rank's heads, and the all-to-all back: (out, lse) of this rank's rows."""
    qh, kh, vh = (_seq_to_heads(t, group, world) for t in (q, k, v))
    spec = dataclasses.replace(spec, head_offset=rank * qh.shape[2])
    out, lse = LocalAttention.apply(qh, kh, vh, positions, positions, spec, local)
    if sink is not None:
        from flash_cute.api.interface import fold_sink
        heads = q.shape[2] // world
        out, lse = fold_sink(out, lse, sink[rank * heads:(rank + 1) * heads], False)
    return _heads_to_seq(out, group, world), _lse_to_seq(lse, group, world)


def ulysses_attention(q, k, v, group=None, layout: str = "contiguous", causal: bool = False,
                      window_size=(-1, -1), softcap: float = 0.0, softmax_scale=None,
                      learnable_sink=None, score_mod=None, mask_mod=None,
                      dropout_p: float = 0.0, return_lse: bool = False, mesh_dim=None,
                      local=None, dropout_seed=None):
    """Attention over a sequence sharded in `layout` across the ranks of `group`, by two
    all-to-alls (DeepSpeed-Ulysses). Arguments and result as `ring.ring_attention`'s; the
    group's size must divide the K/V heads."""
    group = comm.resolve_group(group, mesh_dim)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error = ulysses_refusal(q, k, v, layout, world) or dropout_refusal(dropout_p)
    spec = spec_of(q.shape[-1] if error is None else 1, softmax_scale, causal, window_size,
                   softcap, score_mod, mask_mod)
    spec = with_dropout(spec, dropout_p, dropout_seed, q)
    agreed = comm.agree(group, header(2, q, k, v, layout, spec, world, learnable_sink)
                        if error is None else {}, error)
    spec = dataclasses.replace(spec, seed=agreed.seed)
    shards = Shards(layout, world, q.shape[1] * world)
    positions = concat_rows([shards.rows(r) for r in range(world)])
    out, lse = _ulysses(q, k, v, group, world, rank, positions, spec, learnable_sink,
                        local or default_local(q))
    return (out, lse) if return_lse else out


def hybrid_attention(q, k, v, mesh, ring_dim="ring", ulysses_dim="ulysses",
                     layout: str = "contiguous", causal: bool = False, window_size=(-1, -1),
                     softcap: float = 0.0, softmax_scale=None, learnable_sink=None,
                     score_mod=None, mask_mod=None, dropout_p: float = 0.0,
                     return_lse: bool = False, local=None, dropout_seed=None):
    """Ulysses inside each group of `mesh`'s `ulysses_dim`, the ring (in `layout`) across
    `ring_dim`: a 2-D DeviceMesh. Rank (r, u) holds sub-shard u of ring shard r
    (`hybrid_shard`). The Ulysses degree must divide the K/V heads."""
    ring_group = mesh.get_group(ring_dim)
    uly_group = mesh.get_group(ulysses_dim)
    ring_world, uly_world = dist.get_world_size(ring_group), dist.get_world_size(uly_group)
    error = ulysses_refusal(q, k, v, "contiguous", uly_world)
    if error is None:
        error = local_refusal(q, k, v, layout, ring_world * uly_world) or \
            dropout_refusal(dropout_p)
    spec = spec_of(q.shape[-1] if error is None else 1, softmax_scale, causal, window_size,
                   softcap, score_mod, mask_mod)
    spec = with_dropout(spec, dropout_p, dropout_seed, q)
    head = header(3, q, k, v, layout, spec, ring_world * uly_world, learnable_sink) \
        if error is None else {}
    # Two exchanges that every rank joins: the second carries the first's verdict (and its
    # seed) across the other dim, so a refusal anywhere reaches every rank of the mesh.
    first = comm.agree(uly_group, head, error, raise_now=False)
    if head:
        head = {**head, "seed": first.seed}
    second = comm.agree(ring_group, head, first.error, raise_now=True)
    spec = dataclasses.replace(spec, seed=second.seed)
    local = local or default_local(q)
    qh, kh, vh = (_seq_to_heads(t, uly_group, uly_world) for t in (q, k, v))
    spec = dataclasses.replace(spec, head_offset=dist.get_rank(uly_group) * qh.shape[2])
    shards = Shards(layout, ring_world, qh.shape[1] * ring_world)
    out, lse = _RingAttention.apply(qh, kh, vh, spec, shards, ring_group, local)
    if learnable_sink is not None:
        from flash_cute.api.interface import fold_sink
        heads = q.shape[2] // uly_world
        u = dist.get_rank(uly_group)
        out, lse = fold_sink(out, lse, learnable_sink[u * heads:(u + 1) * heads], False)
    out = _heads_to_seq(out, uly_group, uly_world)
    if not return_lse:
        return out
    return out, _lse_to_seq(lse, uly_group, uly_world)


def hybrid_positions(seqlen: int, layout: str, ring_world: int, uly_world: int, ring_rank: int,
                     uly_rank: int) -> torch.Tensor:
    """The global positions rank (ring_rank, uly_rank) of a hybrid holds: the uly_rank-th
    contiguous piece of ring shard ring_rank.

    Args:
        seqlen: the full sequence's length.
        layout: the ring's layout.
        ring_world: ranks in the ring.
        uly_world: ranks in each Ulysses group.
        ring_rank: this rank's place in the ring.
        uly_rank: this rank's place in its Ulysses group.

    Returns:
        int64 [seqlen / (ring_world · uly_world)].

    Raises:
        ValueError: as `positions`, for the ring's shard."""
    ring_shard = layouts.positions(seqlen, layout, ring_world, ring_rank)
    piece = ring_shard.shape[0] // uly_world
    return ring_shard[uly_rank * piece:(uly_rank + 1) * piece]


document(ulysses_attention, CP_RETURNS, CP_RAISES,
         **{**CP_ARGS, "k": "[b, s_local, hk, d], hk a multiple of the group's size."})
document(hybrid_attention, CP_RETURNS, CP_RAISES, **{
    **CP_ARGS, "q": "this rank's sub-shard, [b, s_local, h, d].",
    "mesh": "a 2-D DeviceMesh.", "ring_dim": "the mesh dim the ring runs across.",
    "ulysses_dim": "the mesh dim of the Ulysses groups (its size divides the K/V heads)."})
