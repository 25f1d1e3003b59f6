"""Ring attention: each rank holds a shard of the sequence (`layouts`); K/V blocks travel
round the ring and each rank merges its queries' partial results over every block by their
LSE, in the local attention's partial dtype (float32 or float64), never rounded to 16 bits
between steps.

Forward, w steps: at step s the rank holds the block of rank (r − s) mod w, posts its send
to rank r + 1 and the receive of the next block, runs the local attention over the block it
holds (skipped when the mask leaves it empty), merges, then waits for the exchange.
Backward, w steps: dQ accumulates on the rank; each block's dK / dV accumulators travel one
step behind it (sent after a step's share is added, received while the next step computes)
and gain each rank's share, and one last exchange brings them home. P and Δ come
from the merged output and LSE (`local.Float64Local.backward`), as the kernels take them.
GQA sends the K/V heads only.
"""

from __future__ import annotations

import dataclasses

import torch

from flash_cute.api.params import document
from flash_cute.parallel import comm, layouts
from flash_cute.parallel.local import (
    LocalAttention,
    OperatorLocal,
    Rows,
    Spec,
    band_calls,
    merge,
    spec_of,
)

LAYOUT_CODES = {name: i + 1 for i, name in enumerate(layouts.LAYOUTS)}


def default_local(q):
    """The local attention a call gets without `local=`: the operators."""
    return OperatorLocal()


class Shards:
    """Which rows each rank of a call holds: `layout` over `world` ranks of a padded
    sequence (`seqlen`) or, with `cu_seqlens`, of packed documents sharded one by one."""

    def __init__(self, layout: str, world: int, seqlen: int = 0, cu_seqlens=None):
        self.layout, self.world, self.seqlen = layout, world, seqlen
        self.cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens]

    def rows(self, rank: int) -> Rows:
        if self.cu is None:
            return Rows(layouts.positions(self.seqlen, self.layout, self.world, rank))
        _, doc, pos = layouts.varlen_rows(self.cu, self.layout, self.world, rank)
        return Rows(pos, doc)


def concat_rows(parts) -> Rows:
    """Rows of tensors concatenated along their sequence dim."""
    docs = [p.doc for p in parts]
    return Rows(torch.cat([p.pos for p in parts]),
                None if docs[0] is None else torch.cat(docs))


def _visible(qr: Rows, kr: Rows, spec: Spec) -> bool:
    """Whether the band leaves any (query, key) pair of this block visible (a mask mod can
    only hide more)."""
    return bool(band_calls(qr, kr, spec))


def ring_forward(q, k, v, spec: Spec, shards: Shards, group, local):
    """The ring's forward: (O, LSE) of this rank's rows in the local attention's partial
    dtype. Keeps nothing: a call without gradients (inference) runs this alone."""
    ring = comm.Ring(group)
    q_pos = shards.rows(ring.rank)
    pd = local.partial_dtype
    b, sq, h = q.shape[:3]
    out = torch.zeros(b, sq, h, v.shape[3], dtype=pd, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=pd, device=q.device)
    block = (k, v)
    for step in range(ring.world):
        pending = ring.start(block) if step < ring.world - 1 else None
        k_pos = shards.rows((ring.rank - step) % ring.world)
        if _visible(q_pos, k_pos, spec):
            o, l_ = local.forward(q, *block, q_pos, k_pos, spec)
            out, lse = merge(out, lse, o, l_)
        if pending is not None:
            block = tuple(comm.Ring.finish(pending))
    return out, lse


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, spec, shards, group, local):
        out, lse = ring_forward(q, k, v, spec, shards, group, local)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.shards, ctx.group, ctx.local = spec, shards, group, local
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        spec, local = ctx.spec, ctx.local
        ring = comm.Ring(ctx.group)
        q_pos = ctx.shards.rows(ring.rank)
        pd = local.partial_dtype
        delta = (dout.to(pd) * out).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse.to(pd)
        dq = torch.zeros(q.shape, dtype=pd, device=q.device)
        block = (k, v)
        acc = (torch.zeros(k.shape, dtype=pd, device=k.device),
               torch.zeros(v.shape, dtype=pd, device=v.device))
        moving = None   # the accumulators of the block held, still arriving
        for step in range(ring.world):
            last = step == ring.world - 1
            pending = None if last else ring.start(block)
            k_pos = ctx.shards.rows((ring.rank - step) % ring.world)
            grads = None
            if _visible(q_pos, k_pos, spec):
                dq_s, dk_s, dv_s = local.backward(dout, delta, q, *block, lse, q_pos, k_pos,
                                                  spec)
                dq += dq_s
                grads = (dk_s, dv_s)
            # The accumulators follow their block, one step behind it: they travel while
            # this step computes, and after w sends they are home.
            if moving is not None:
                acc = tuple(comm.Ring.finish(moving))
            if grads is not None:
                acc = (acc[0] + grads[0], acc[1] + grads[1])
            moving = ring.start(acc)
            if pending is not None:
                block = tuple(comm.Ring.finish(pending))
        acc = tuple(comm.Ring.finish(moving))
        return (dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None)


def header(kind: int, q, k, v, layout: str, spec: Spec, world: int, sink) -> dict:
    """The fields every rank of a call must agree on (`comm.agree`)."""
    return dict(kind=kind, batch=q.shape[0], seqlen_local=q.shape[1], heads=q.shape[2],
                heads_kv=k.shape[2], head_dim=q.shape[3], head_dim_v=v.shape[3],
                dtype=comm.DTYPE_CODES.get(q.dtype, 99), layout=LAYOUT_CODES.get(layout, 99),
                causal=int(spec.right == 0 and spec.left is None),
                window_left=-1 if spec.left is None else spec.left,
                window_right=-1 if spec.right is None else spec.right,
                softcap_micro=round(spec.softcap * 1e6), world=world,
                mods=int(spec.score_mod is not None) + 2 * int(spec.mask_mod is not None),
                sink=int(sink is not None), dropout_micro=round(spec.dropout_p * 1e6),
                seed=spec.seed)


def local_refusal(q, k, v, layout: str, world: int, heads_divisor: int = 1):
    """This rank's reason to refuse the call (a string), found without communicating, or
    None. Raised by `comm.agree` after every rank has joined the header exchange."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k and v must be tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k, v must be [batch, seqlen_local, heads, head_dim], got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return (f"q, k, v shards must share batch and seqlen_local, k and v their heads, q and "
                f"k their head_dim: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} K/V heads"
    if layout not in layouts.LAYOUTS:
        return f"layout must be one of {layouts.LAYOUTS}, got {layout!r}"
    multiple = layouts.shard_multiple(layout, world) // world
    if q.shape[1] % multiple:
        return (f"the {layout} layout needs every rank's shard to be a multiple of {multiple} "
                f"tokens (the sequence a multiple of {multiple * world}), got a shard of "
                f"{q.shape[1]}: pad the sequence")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def dropout_refusal(dropout_p):
    """The reason to refuse `dropout_p`, or None."""
    if not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        return f"dropout_p must be a float in [0, 1), got {dropout_p!r}"
    return None


def with_dropout(spec: Spec, dropout_p, seed, q) -> Spec:
    """`spec` with dropout: its probability, this rank's seed (`seed`, or one drawn from
    torch's generator; the call then uses rank 0's) and the call's query heads."""
    if not dropout_p:
        return spec
    if seed is None:
        seed = int(torch.randint(0, 1 << 62, (1,)))
    return dataclasses.replace(spec, dropout_p=float(dropout_p), seed=int(seed),
                               heads=q.shape[2] if isinstance(q, torch.Tensor) else 0)


def _packed_refusal(q, cu_seqlens, layout: str, world: int):
    """This rank's reason to refuse packed documents, or None."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
        return "cu_seqlens must be a 1-D int32/int64 tensor of the documents' global offsets"
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        return f"cu_seqlens must start at 0 and not decrease, got {cu}"
    if cu[-1] != q.shape[0] * world:
        return (f"cu_seqlens ends at {cu[-1]} tokens, but {world} ranks of {q.shape[0]} "
                f"packed rows hold {q.shape[0] * world}")
    try:
        layouts.varlen_rows(cu, layout, world, 0)
    except ValueError as e:
        return str(e)
    return None


def _cu_check(cu_seqlens) -> dict:
    """Header fields that tell two ranks' cu_seqlens apart."""
    if cu_seqlens is None:
        return {}
    cu = [int(c) for c in cu_seqlens.tolist()]
    return {"docs": len(cu), "cu_check": sum((i + 1) * c for i, c in enumerate(cu)) % (1 << 62)}


def _allgather_attention(q, k, v, spec: Spec, shards: Shards, group, local):
    """Llama 3's context parallelism: every rank gathers all K/V (an all-gather whose
    backward sums each rank's dK / dV shares back to their owners) and attends with its
    queries at their positions: one exchange per call instead of w − 1 ring steps."""
    from torch.distributed.nn.functional import all_gather

    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    k_all, v_all = (torch.cat(all_gather(comm.to_host(t, group).contiguous(), group=group),
                              dim=1).to(t.device) for t in (k, v))
    k_rows = concat_rows([shards.rows(r) for r in range(world)])
    return LocalAttention.apply(q, k_all, v_all, shards.rows(rank), k_rows, spec, local)


def ring_attention(q, k, v, group=None, layout: str = "contiguous", causal: bool = False,
                   window_size=(-1, -1), softcap: float = 0.0, softmax_scale=None,
                   learnable_sink=None, score_mod=None, mask_mod=None, dropout_p: float = 0.0,
                   return_lse: bool = False, mesh_dim=None, local=None, cu_seqlens=None,
                   mode: str = "ring", dropout_seed=None):
    """Attention over a sequence sharded across the ranks of `group` (a ProcessGroup, a
    DeviceMesh and `mesh_dim`, or None for the default group) in `layout` ("contiguous",
    "striped", "zigzag"; `shard` makes the shards). q [b, s_local, h, d], k / v [b, s_local,
    hk, d]: this rank's shard; or packed documents, q [t_local, h, d] with `cu_seqlens` the
    documents' global offsets, each document sharded on its own (`layouts.varlen_rows`).
    Masks, the window, the softcap, the mods (FlexAttention's form; b is the document when
    packed) and the sink see global positions, so the result is the rows of unsharded
    attention that this rank holds. Dropout draws its decisions at global coordinates from
    one seed (rank 0's `dropout_seed`, or one it draws), as the single-process call with
    that seed does. Differentiable. `mode`: "ring" (K/V blocks travel round
    the ring) or "allgather" (Llama 3's: all K/V gathered on every rank). `local`: the
    local attention (`flash_cute.parallel.local`; default the operators). Returns out (and
    the LSE, [b, h, s_local] or [h, t_local], with `return_lse`)."""
    group = comm.resolve_group(group, mesh_dim)
    world = torch.distributed.get_world_size(group)
    packed = cu_seqlens is not None
    q4, k4, v4 = (t.unsqueeze(0) if packed and isinstance(t, torch.Tensor) else t
                  for t in (q, k, v))
    error = local_refusal(q4, k4, v4, "contiguous" if packed else layout, 1 if packed else world)
    if error is None and packed:
        error = _packed_refusal(q, cu_seqlens, layout, world)
    if error is None:
        error = dropout_refusal(dropout_p)
    if error is None and mode not in ("ring", "allgather"):
        error = f"mode must be 'ring' or 'allgather', got {mode!r}"
    spec = spec_of(q.shape[-1] if error is None else 1, softmax_scale, causal, window_size,
                   softcap, score_mod, mask_mod)
    spec = with_dropout(spec, dropout_p, dropout_seed, q4)
    head = header(1 if mode == "ring" else 4, q4, k4, v4, layout, spec, world,
                  learnable_sink) if error is None else {}
    agreed = comm.agree(group, {**head, **(_cu_check(cu_seqlens) if error is None else {})},
                        error)
    spec = dataclasses.replace(spec, seed=agreed.seed)
    shards = Shards(layout, world, q4.shape[1] * world, cu_seqlens if packed else None)
    local = local or default_local(q)
    if mode == "allgather":
        out, lse = _allgather_attention(q4, k4, v4, spec, shards, group, local)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _RingAttention.apply(q4, k4, v4, spec, shards, group, local)
    else:
        # Inference: the forward alone, nothing saved.
        out, lse = ring_forward(q4, k4, v4, spec, shards, group, local)
        out = out.to(q.dtype)
    if learnable_sink is not None:
        from flash_cute.api.interface import fold_sink
        out, lse = fold_sink(out, lse, learnable_sink, False)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


# The context-parallel functions' own parameters (`api.params.document` adds the shared ones).
CP_ARGS = dict(
    q="this rank's shard, [b, s_local, h, d], or packed [t_local, h, d].",
    k="[b, s_local, hk, d] (hk dividing h), or packed [t_local, hk, d].",
    v="like k.",
    group="a ProcessGroup, a DeviceMesh (with mesh_dim), or None for the world.",
    layout="\"contiguous\" (default), \"striped\" or \"zigzag\".",
    causal="the causal mask, at global positions.",
    window_size="(left, right), -1 for an unbounded side, at global positions.",
    score_mod="FlexAttention's score_mod(score, b, h, q_idx, kv_idx), at global positions.",
    mask_mod="FlexAttention's mask_mod(b, h, q_idx, kv_idx), at global positions.",
    dropout_p="dropout of the attention weights, drawn at global coordinates.",
    mesh_dim="the DeviceMesh dim, when group is a mesh of more than one.",
    local="the local attention (flash_cute.parallel.local), default the operators.",
    cu_seqlens="int32, the packed documents' global offsets.",
    mode="\"ring\" (default) or \"allgather\".",
    dropout_seed="rank 0's seed for the dropout decisions (default: one it draws).",
    return_lse="also return the LSE, [b, h, s_local] or [h, t_local].",
)
CP_RETURNS = "out, this rank's rows in q's dtype; or (out, lse) with return_lse."
CP_RAISES = """Raises:
    ValueError: on every rank, when any rank's input is refused (a length the layout cannot
        shard, an unknown layout or mode, a dropout_p outside [0, 1), shapes the local
        attention cannot take; for Ulysses, a group size that does not divide the K/V heads,
        before any collective) or the ranks' headers (shapes, dtypes, layout, options)
        disagree.
    RuntimeError: torch.distributed is not initialized."""
document(ring_attention, CP_RETURNS, CP_RAISES, **CP_ARGS)

__all__ = ["ring_attention"]
