"""What the parallel functions say to each other through torch.distributed: the group a call
runs on, the header every call agrees on first, and the ring's neighbour exchange.

**The header.** A rank whose tensors differ from the others' (shape, dtype, layout, world)
would post receives of the wrong size, and a rank that refuses its input locally would leave
the others waiting in a collective. So every call starts with one fixed-size all-gather of
a small int64 header (shapes, dtype, layout, mask, the local refusal if any): every rank
joins it whatever its input, every rank sees every header, and every rank raises the same
error when they differ (docs/decisions.md, D-CP-HEADER). A check "once per new shape" would
hang: a rank that saw a new shape would join a collective that the others skip.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}

HEADER_FIELDS = ("kind", "batch", "seqlen_local", "heads", "heads_kv", "head_dim",
                 "head_dim_v", "dtype", "layout", "causal", "window_left", "window_right",
                 "softcap_micro", "world", "mods", "sink", "docs", "cu_check", "dropout_micro",
                 "seed")
# Carried, not compared: every rank adopts rank 0's (`Agreement.seed`).
_SHARED = ("seed",)


class Agreement(NamedTuple):
    """What `agree` found: the error (None when all agree) and every rank's header."""
    error: Optional[str]
    rows: list

    @property
    def seed(self) -> int:
        """Rank 0's dropout seed: the one every rank of the call uses."""
        return self.rows[0][HEADER_FIELDS.index("seed")]


def resolve_group(group=None, mesh_dim=None):
    """A ProcessGroup from `group`: None (the default group), a ProcessGroup, a 1-D
    DeviceMesh, or a DeviceMesh with `mesh_dim` (its name or index)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_cute.parallel needs torch.distributed initialized "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):            # a DeviceMesh
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"a {group.ndim}-D DeviceMesh needs mesh_dim (one of "
                             f"{group.mesh_dim_names})")
        return group.get_group(mesh_dim) if mesh_dim is not None else group.get_group()
    return group


def comm_device(group) -> torch.device:
    """Where the group's tensors live: CUDA for NCCL, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, header: dict, error: Optional[str], raise_now: bool = True) -> Agreement:
    """Every rank of `group` joins one all-gather of its header and its local refusal
    (`error`, or None); then every rank raises if any rank refused or any header differs,
    naming the ranks and the fields. With `raise_now` False the error is returned instead
    (`Agreement.error`), for a caller that first passes it through a second group."""
    values = [int(header.get(name, 0)) for name in HEADER_FIELDS] + [int(error is not None)]
    mine = torch.tensor(values, dtype=torch.int64, device=comm_device(group))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.tolist() for g in gathered]
    found = error if error is not None else _disagreement(rows)
    if found is not None and raise_now:
        raise ValueError(found)
    return Agreement(found, rows)


def _disagreement(rows) -> Optional[str]:
    refused = [r for r, row in enumerate(rows) if row[-1]]
    if refused:
        return (f"rank(s) {refused} of this call's group refused their input (each raised "
                f"why); no rank ran the attention")
    differing = [name for i, name in enumerate(HEADER_FIELDS)
                 if name not in _SHARED and len({row[i] for row in rows}) > 1]
    if not differing:
        return None
    detail = "; ".join(f"{name}: " + ", ".join(f"rank {r} {row[HEADER_FIELDS.index(name)]}"
                                               for r, row in enumerate(rows))
                       for name in differing)
    return (f"the ranks of this call's group disagree on {differing} ({detail}): every rank "
            f"must pass the same shapes, dtype and options")


def staged(group) -> bool:
    """Whether tensors of `group`'s collectives go through host memory: gloo sends CPU
    tensors only, so CUDA tensors (ranks sharing one GPU, whose NCCL refuses two ranks) are
    copied to the host and back."""
    return dist.get_backend(group) == "gloo" and torch.cuda.is_available()


def to_host(t: torch.Tensor, group) -> torch.Tensor:
    """`t` as `group`'s collectives take it (a differentiable copy to the host when staged)."""
    return t.cpu() if t.is_cuda and staged(group) else t


class Ring:
    """The neighbour exchange of a ring over `group`: each rank sends to rank + 1 and
    receives from rank − 1, every message posted at once (`batch_isend_irecv`) and waited
    for when its tensors are needed, so a step's attention runs while the next block
    travels."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors):
        """Send `tensors` on and post receives of their like; returns the pending exchange
        (`finish` gives the received tensors)."""
        devices = [t.device for t in tensors]
        sent = [to_host(t, self.group).contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        # The sent tensors stay referenced until the exchange is waited for.
        return dist.batch_isend_irecv(ops), received, sent, devices

    @staticmethod
    def finish(pending):
        requests, received, _, devices = pending
        for request in requests:
            request.wait()
        return [r.to(d) for r, d in zip(received, devices)]
