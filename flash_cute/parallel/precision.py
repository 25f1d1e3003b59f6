"""Why the ring keeps its partials in float32: a one-process simulation of a ring of `world`
ranks (contiguous shards), its partial outputs and running merge kept either in float32 or
rounded to the inputs' 16-bit dtype after every step (what a ring that merges 16-bit block
outputs does), each judged by the FlashAttention rule against float64 attention over the
whole sequence. The 16-bit ring's error grows with the number of steps a row merges; the
float32 ring's does not."""

from __future__ import annotations

import torch

from flash_cute.parallel import layouts
from flash_cute.parallel.local import Float64Local, Rows, merge, spec_of


def simulate_ring(q, k, v, world: int, partial_dtype: torch.dtype, causal: bool = False):
    """The ring's output for the whole sequence (q, k, v [b, L, h, d], one process): each
    rank's queries against every block, block outputs and the running merge held in
    `partial_dtype`; the merge arithmetic in float32 at least."""
    seqlen = q.shape[1]
    spec = spec_of(q.shape[-1], causal=causal)
    exact = Float64Local()
    rows = []
    for rank in range(world):
        q_pos = layouts.positions(seqlen, "contiguous", world, rank)
        out = lse = None
        for step in range(world):
            src = (rank - step) % world
            k_pos = layouts.positions(seqlen, "contiguous", world, src)
            o, l_ = exact.forward(q[:, q_pos], k[:, k_pos], v[:, k_pos], Rows(q_pos),
                                  Rows(k_pos), spec)
            o, l_ = o.to(partial_dtype), l_.float()
            if out is None:
                out, lse = o, l_
                continue
            wide = torch.promote_types(partial_dtype, torch.float32)
            merged, lse = merge(out.to(wide), lse, o.to(wide), l_)
            out = merged.to(partial_dtype)
        rows.append(out)
    return torch.cat(rows, dim=1)
