"""The compile-time shape of an attention call: which masks, softcap and layout a kernel handles.

Every arch kernel takes one `Variant`; run-time values (window sizes, softcap value, scale,
lengths) stay kernel arguments. `flags()` is the variant's part of a CompileKey. `seqused_q` /
`seqused_k` are switches because a kernel compiled with those tensors differs from one
compiled with None in their record fields (their values stay run-time). `pack_gqa` is the number of
query heads a tile packs into its rows (1: none; see `flash_cute.runtime.launch.packed_heads`).
`dropout`: the kernel drops attention weights (`flash_cute.blocks.dropout`; p, the seed and the
scale are run-time); `dropout_frame` ("shift", "frame"; "" none) the form of the seed's frame,
the coordinates in a larger attention where a ring step's kernel draws (`constants`).
`split_kv`: the forward writes fp32 partial results per key split for
`flash_cute.blocks.lse_merge` (split-KV; the split count and size are run-time). `page_size` > 0: K
and V are a paged cache [pages, page_size, heads_kv, d] read through a page table (its rows are
compile-time, the table and its lengths run-time; seqused_k gives the lengths). `append`: the
forward first writes new keys and values (k_new / v_new, the last rows of each sequence's seqused_k)
into the cache it reads (the decode step's in-place append, `flash_attn_with_kvcache`).
`ex2_per16`: of every 16 scores of a thread's softmax row, how many take the FMA exp2
instead of MUFU.EX2 (`flash_cute.blocks.exp2_emu`; 0: none). `mods`: the call's traced score and
mask mods as the kernel compiles them (`flash_cute.contract.mods.KernelMods`; their captured
tensors are run-time, `FwdArgs.aux0`..); its hash joins the flags.
"""

import os
from dataclasses import dataclass
from typing import Any

# The forwards' software-exp2 share (`Variant.ex2_per16`), read when a call's plan is made.
EX2_EMULATION_ENV = "FLASH_CUTE_EX2_EMULATION"

# Compile-key names of the tensor dtypes, by torch dtype name (no torch import here).
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                "torch.float8_e4m3fn": "e4m3", "torch.float8_e5m2": "e5m2"}


def dtype_name(dtype) -> str:
    """"bf16", "fp16", "fp32", "e4m3" or "e5m2" for a torch dtype."""
    return _DTYPE_NAMES[str(dtype)]


@dataclass(frozen=True)
class Variant:
    causal: bool = False
    window_left: bool = False
    window_right: bool = False
    softcap: bool = False
    varlen: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    pack_gqa: int = 1
    dropout: bool = False
    # Dropout's seed carries a coordinate frame: "shift" or "frame" (`constants`; "" none).
    dropout_frame: str = ""
    split_kv: bool = False
    page_size: int = 0
    append: bool = False
    ex2_per16: int = 0
    mods: Any = None
    # Record the warp roles' phase boundaries (`contract.timeline`) for a sample of CTAs.
    timeline: bool = False

    def __post_init__(self):
        # Causal is the window (left, 0): a right window on top of it means nothing.
        if self.causal and self.window_right:
            object.__setattr__(self, "window_right", False)
        # A seed's frame means nothing without dropout.
        if not self.dropout and self.dropout_frame:
            object.__setattr__(self, "dropout_frame", "")
        if self.softcap and self.mods is not None and self.mods.score is not None:
            raise ValueError("softcap with a traced score mod: write the softcap inside the mod "
                             "(flash_cute.variants.examples.softcap)")

    def flags(self) -> tuple:
        flags = (("causal", self.causal), ("left", self.window_left), ("right", self.window_right),
                 ("softcap", self.softcap), ("varlen", self.varlen), ("seqused_q", self.seqused_q),
                 ("seqused_k", self.seqused_k))
        # Only where they are on, so the other kernels keep their keys.
        flags += (("pack_gqa", self.pack_gqa),) if self.pack_gqa > 1 else ()
        flags += (("dropout", self.dropout_frame or True),) if self.dropout else ()
        flags += (("split_kv", True),) if self.split_kv else ()
        flags += (("page", self.page_size),) if self.page_size else ()
        flags += (("append", True),) if self.append else ()
        flags += (("ex2_emu", self.ex2_per16),) if self.ex2_per16 else ()
        flags += (("timeline", True),) if self.timeline else ()
        return flags + ((("mods", self.mods.key()),) if self.mods is not None else ())


def kernel_head_dims(pipeline: str, hdim: int, hdim_v, schedules: dict, schedule) -> tuple:
    """(hdim, hdim_v) of a forward kernel: a schedule exists (or is given) and hdim_v ≤ hdim is
    a multiple of 32 (O reuses Q's shared-memory tile)."""
    hdim_v = hdim if hdim_v is None else hdim_v
    if hdim not in schedules and schedule is None:
        raise ValueError(f"no {pipeline} schedule for hdim {hdim}; have {sorted(schedules)}")
    if hdim_v > hdim or hdim_v % 32:
        raise ValueError(f"hdim_v must be a multiple of 32 and <= hdim, got {hdim_v}/{hdim}")
    return hdim, hdim_v


def per16_of(fraction: float) -> int:
    """A share of a row's exponentials as `Variant.ex2_per16` (0 to 16): exact sixteenths
    only, so that the share is what inspect's MUFU.EX2 count shows."""
    per16 = round(fraction * 16)
    if not 0 <= per16 <= 16 or abs(per16 - fraction * 16) > 1e-9:
        raise ValueError(f"ex2_emulation_fraction must be a multiple of 1/16 in [0, 1], "
                         f"got {fraction}")
    return per16


def ex2_emulation_per16() -> int:
    """The forwards' software-exp2 switch: the share of each softmax row's exponentials that
    `flash_cute.blocks.exp2_emu` computes with FMAs, from ``FLASH_CUTE_EX2_EMULATION`` (a fraction
    in sixteenths, e.g. 0.125; unset or 0: none). Read when a call's plan is made
    (`plans.clear_plans` re-reads it)."""
    text = os.environ.get(EX2_EMULATION_ENV, "").strip()
    if not text:
        return 0
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"{EX2_EMULATION_ENV}={text!r} is not a number") from None
    return per16_of(fraction)
