"""`KernelConfig`: one entry of the table of kernel configurations that `inspect` compiles.

Data only (no CuTe DSL import): each pipeline lists its entries in `arch/<name>/inspect_configs.py`
and `flash_cute.tools.registry` gathers them with the shared blocks' own. An entry's `builder`,
called inside a compile worker, returns what to compile (`CompileSpec`). An entry's flags
name its `Variant` (`variant_from_flags`), and its mods a documented example's
(`example_spec`).
A kernel is named ``<pipeline>.<role>``: ``ampere.fwd``, ``hopper.bwd``, ... for the
attention pipelines, ``blocks.*`` for the shared blocks' own kernels.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

from flash_cute.contract.variant import Variant


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
                             merged=kernel.split_kv and getattr(kernel, "merges_splits", False),
                             timeline=getattr(kernel, "timeline", False),
                             out_dtype=getattr(kernel, "out_dtype", None),
                             descales=getattr(kernel, "takes_descales", 0))
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


def variant_from_flags(flags: dict) -> Variant:
    """From a registry config's flags (``local`` means both window sides)."""
    local = flags.get("local", False)
    return Variant(causal=flags.get("causal", False), window_left=local, window_right=local,
                   softcap=flags.get("softcap", False), varlen=flags.get("varlen", False),
                   seqused_q=flags.get("seqused_q", False),
                   seqused_k=flags.get("seqused_k", False),
                   pack_gqa=flags.get("pack_gqa", 1),
                   dropout=bool(flags.get("dropout", False)),
                   dropout_frame=flags.get("dropout") if flags.get("dropout") in ("shift", "frame")
                   else "",
                   split_kv=flags.get("split_kv", False), page_size=flags.get("page", 0),
                   append=flags.get("append", False), ex2_per16=flags.get("ex2_emu", 0),
                   timeline=flags.get("timeline", False),
                   mods=None if flags.get("mods") is None else example_spec(flags["mods"]))


_SPECS = {}


def example_spec(name: str):
    """The `contract.mods.KernelMods` of example `name` (as `variants.examples.by_name` builds
    it); a name ending in "+blocks" adds the block mask `create_block_mask` makes of its mask mod
    (the kernels' block sparsity); one ending in "+grads" is a backward's with its float captured
    tensors learnable (their gradients accumulated, `KernelMods.aux_grads`); one starting
    "fa4_" is an FA4-form example's `Fa4Spec` (`flash_cute.blocks.fa4_mod_examples`)."""
    if name.startswith("fa4_"):
        from flash_cute.blocks.fa4_mod_examples import EXAMPLES
        from flash_cute.variants.fa4_spec import fa4_spec

        score, mask, bwd, aux, *rest = EXAMPLES[name.removesuffix("+blocks")]
        scalars = rest[0] if rest else ()
        if not name.endswith("+blocks"):
            return fa4_spec(score, mask, bwd, aux, scalars)
        # A block mask's states join the aux tensors last (`registry.register_fa4`).
        return fa4_spec(score, mask, bwd, aux + (("i32", 4),), scalars, (128, 128))
    if name not in _SPECS:
        import torch

        from flash_cute.variants.examples import by_name
        from flash_cute.variants.kernel_view import kernel_mods
        from flash_cute.variants.registry import CallMods
        from flash_cute.variants.tracer import trace

        examples = by_name()
        grads = name.endswith("+grads")
        base = name.removesuffix("+grads").removesuffix("+blocks")
        if base not in examples:
            raise KeyError(f"no mod example {base!r}; have {sorted(examples)}")
        score, mask = examples[base]
        if grads:
            for t in trace(score, "score").aux:
                if t.is_floating_point():
                    t.requires_grad_()
        states = size = None
        if name.removesuffix("+grads").endswith("+blocks"):
            from flash_cute.variants.block_mask import block_states, create_block_mask

            block_mask = create_block_mask(mask, 1, 1, 256, 256, device="cpu")
            states, size = block_states(block_mask).to(torch.int32), (128, 128)
        variant = CallMods(None if score is None else trace(score, "score"),
                          None if mask is None else trace(mask, "mask"), states, size)
        _SPECS[name] = kernel_mods(variant, grads)[0]
    return _SPECS[name]
