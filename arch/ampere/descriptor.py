"""The ampere pipeline's descriptor: sm80 code (cp.async + mma.sync), which runs on every GPU
from sm80 on."""

from flash_cute.contract import descriptor as caps
from flash_cute.contract.descriptor import Descriptor

from .config import SUPPORTED_HDIMS

AMPERE = Descriptor(
    name="ampere",
    majors=range(8, 13),
    # dQ is added with fp32 atomics, so its rounding depends on the order CTAs finish: no
    # deterministic backward.
    capabilities=frozenset({caps.FORWARD, caps.BACKWARD, caps.CAUSAL, caps.LOCAL, caps.SOFTCAP,
                            caps.GQA, caps.VARLEN, caps.SEQUSED, caps.DROPOUT,
                            caps.MODS, caps.BLOCK_SPARSE}),
    head_dims=tuple(sorted(SUPPORTED_HDIMS)),
    backward_head_dims=tuple(sorted(SUPPORTED_HDIMS)),
    decode=("split-KV", "paged K/V (pages gathered first)"),
    # Run as sm_80 code on Hopper cards (its majors include 9); never on an A100.
    verified="H100 80GB HBM3 (as sm_80 code), 2026-12-06",
)
