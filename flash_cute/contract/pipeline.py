"""A kernel's pipeline as data: its warp roles (warps, register budget, what each does) and its
buffers (which tensor, in which memory, how many stages, produced and consumed by which role,
through which barrier). Each kernel class declares its own (`pipeline()`), from the same
config values it compiles with; `flash_cute.tools.pipelines` checks the declaration against
the kernel's SASS and draws it. The design chapter's 10.3.6 compares the generations this way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

MEMORIES = ("GMEM", "SMEM", "TMEM", "RMEM")
# The tensors whose residency the comparison shows.
TENSORS = ("Q", "K", "V", "S", "P", "O", "LSE", "dO", "dS", "dQ", "dK", "dV")


@dataclass(frozen=True)
class Role:
    """Warps that run one part of the kernel. `registers`: the per-thread budget that
    setmaxnreg gives them (None: no setmaxnreg, every warp keeps the launch count);
    `warpgroup`: the warpgroup whose setmaxnreg sets it (None without)."""
    name: str
    warps: tuple
    does: str
    registers: Optional[int] = None
    warpgroup: Optional[int] = None


@dataclass(frozen=True)
class Buffer:
    """One place a tensor lives in: `memory` one of MEMORIES, `stages` how many copies
    rotate, `producer` / `consumer` role names (or "TMA", "global"), `barrier` how the
    consumer knows it may read and the producer that it may write again."""
    tensor: str
    memory: str
    stages: int
    producer: str
    consumer: str
    barrier: str


@dataclass(frozen=True)
class Pipeline:
    """A kernel's declared pipeline. `rule`: how its warps split into roles, in words (for a
    kernel without setmaxnreg: all warps one role, or roles by warp index)."""
    kernel: str
    arch: str
    roles: tuple
    buffers: tuple
    rule: str = ""
    notes: tuple = field(default=())

    def __post_init__(self):
        for b in self.buffers:
            if b.memory not in MEMORIES:
                raise ValueError(f"{self.kernel}: buffer {b.tensor} in unknown memory {b.memory}")
        warps = [w for r in self.roles for w in r.warps]
        if sorted(warps) != list(range(len(warps))):
            raise ValueError(f"{self.kernel}: the roles' warps {sorted(warps)} are not 0..n-1 "
                             f"once each")
        per_group = {}
        for r in self.roles:
            if per_group.setdefault(r.warpgroup, r.registers) != r.registers:
                raise ValueError(f"{self.kernel}: warpgroup {r.warpgroup} has two budgets "
                                 f"(setmaxnreg is warpgroup-wide)")
        names = {r.name for r in self.roles} | {"TMA", "global", "-"}
        for b in self.buffers:
            for who in (b.producer, b.consumer):
                if who.split(" + ")[0] not in names:
                    raise ValueError(f"{self.kernel}: buffer {b.tensor} names no role {who!r}")

    def residency(self) -> dict:
        """Each tensor of TENSORS the kernel holds: the memories it lives in, in the order
        declared."""
        out = {}
        for b in self.buffers:
            if b.tensor in TENSORS and b.memory not in out.setdefault(b.tensor, []):
                out[b.tensor].append(b.memory)
        return out

    def budgets(self) -> dict:
        """warpgroup -> setmaxnreg budget, for the roles that set one."""
        return {r.warpgroup: r.registers for r in self.roles if r.registers is not None}

    def uses(self, memory: str) -> bool:
        return any(b.memory == memory for b in self.buffers)

    def role_table(self) -> str:
        """The markdown table of the roles (what the kernel docstrings show)."""
        lines = ["| warps | registers | role |", "|---|---|---|"]
        for r in self.roles:
            warps = _span(r.warps)
            regs = "launch" if r.registers is None else str(r.registers)
            lines.append(f"| {warps} | {regs} | {r.name}: {r.does} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def from_dict(data: dict) -> Pipeline:
    """The inverse of `Pipeline.to_dict` (results come back from worker processes as JSON)."""
    return Pipeline(data["kernel"], data["arch"],
                    tuple(Role(**{**r, "warps": tuple(r["warps"])}) for r in data["roles"]),
                    tuple(Buffer(**b) for b in data["buffers"]), data.get("rule", ""),
                    tuple(data.get("notes", ())))


def _span(warps: tuple) -> str:
    if len(warps) > 1 and list(warps) == list(range(warps[0], warps[-1] + 1)):
        return f"{warps[0]}..{warps[-1]}"
    return ", ".join(map(str, warps))
