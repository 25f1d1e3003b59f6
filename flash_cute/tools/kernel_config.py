"""`KernelConfig`: one entry of the table of kernel configurations that `inspect` compiles.

Data only (no CuTe DSL import): each pipeline lists its entries in `arch/<name>/registry.py`
and `flash_cute.tools.registry` gathers them with the shared blocks' own. An entry's `builder`,
called inside a compile worker, returns what to compile (`CompileSpec`).
A kernel is named ``<pipeline>.<role>``: ``ampere.fwd``, ``hopper.bwd``, ... for the
attention pipelines, ``blocks.*`` for the shared blocks' own kernels.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class KernelConfig:
    kernel: str
    targets: tuple
    dtype: str
    hdim: object
    hdim_v: object
    schedule: tuple
    builder: Callable = field(compare=False)
    flags: tuple = field(default=())

    @property
    def flag_dict(self) -> dict:
        return dict(self.flags)

    @property
    def label(self) -> str:
        """Short unique description, e.g. ``bf16 d-/16 64x64 causal``."""
        on = [k if v is True else f"{k}={v}" for k, v in self.flags if v is not False]
        dims = f"d{self.hdim if self.hdim is not None else '-'}/{self.hdim_v}"
        return " ".join([self.dtype, dims, schedule_label(self.schedule)] + on)

    def config_dict(self) -> dict:
        names = getattr(self.schedule, "_fields", ())
        nums = (list(self.schedule[:3]) if names
                else [x for x in self.schedule if not isinstance(x, bool)])
        out = {"dtype": self.dtype, "hdim": self.hdim, "hdim_v": self.hdim_v, "schedule": nums}
        # A schedule's named switches (e.g. the Hopper forward's overlaps) read like flags, and
        # so do its named numbers past the leading three (the backward's do_stages), when set.
        out.update({n: x for n, x in zip(names[3:], self.schedule[3:]) if x is not None})
        out.update(self.flag_dict)
        if "ex2_emu" in out:
            # The software exp2's share of the softmax exponentials (`exp2_emu`).
            out["ex2_emulation_fraction"] = out["ex2_emu"] / 16
        return out


def schedule_label(schedule) -> str:
    """``128x128x2`` from the leading numbers; a named schedule switch that is on adds
    ``+name``, a named number that is set ``+name=value`` (``64x48x2+swap_dkv+do_stages=1``)."""
    names = getattr(schedule, "_fields", ())
    lead = [str(x) for x in schedule[:3]] if names else [str(x) for x in schedule]
    extra = []
    for n, x in zip(names[3:], schedule[3:]):
        if x is True:
            extra.append(f"+{n}")
        elif not isinstance(x, bool) and x is not None:
            extra.append(f"+{n}={x}")
    return "x".join(lead) + "".join(extra)


def config_flags(**kw) -> tuple:
    return tuple(sorted(kw.items()))


def forward_spec(kernel, options: str, extra: Optional[dict] = None) -> "CompileSpec":
    """An attention forward kernel's CompileSpec: a fake `FwdArgs` of its dtype, head dims
    and layout (padded or varlen, seqused or not), its shared memory and compile options."""
    from flash_cute.tools.fake_args import fake_forward_args

    args = fake_forward_args(kernel.dtype, kernel.hdim, kernel.hdim_v, kernel.varlen,
                             seqused=(kernel.has_seqused_q, kernel.has_seqused_k),
                             dropout=kernel.dropout,
                             split_kv=kernel.split_kv, paged=kernel.page_size > 0,
                             append=getattr(kernel, "append", False),
                             mods=getattr(kernel, "mods", None),
                             merged=kernel.split_kv and getattr(kernel, "merges_splits", False))
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes, options=options,
                       extra=extra or {})


@dataclass
class CompileSpec:
    """What a registry builder returns: the kernel, its fake argument record (or a tuple of
    fake arguments, for a kernel whose `__call__` takes them one by one) and extras."""

    fn: Callable
    args: object
    dynamic_smem_bytes: int = 0
    extra: dict = field(default_factory=dict)
    options: str = ""
