"""The hopper pipeline's descriptor: sm90a code (TMA, WGMMA, warp specialization), which runs
on sm90 only (WGMMA and setmaxnreg exist there alone)."""

from flash_cute.contract import descriptor as caps
from flash_cute.contract.descriptor import Descriptor

from .config import BWD_SUPPORTED_HDIMS, FP8_SUPPORTED_HDIMS, SUPPORTED_HDIMS

HOPPER = Descriptor(
    name="hopper",
    majors=range(9, 10),
    # pack_gqa: the forward packs a K/V head's query heads into one tile
    # (`launch.packed_heads`); the backward runs unpacked (its outputs do not depend on how
    # the forward tiled). deterministic: each query tile's dQ partials are added in a fixed
    # order (a semaphore per query tile, `HopperBwd`). Varlen tiles that TMA loads past a
    # sequence get those rows zeroed in shared memory before a GEMM reads them
    # (`HopperFwd.clear_v_tail`, `BwdStep.clear_tail`), so it takes every problem it supports.
    # fp8: the FP8 forward (`HopperFwdFp8`, `planner.plan_forward_fp8`).
    capabilities=frozenset({caps.FORWARD, caps.BACKWARD, caps.CAUSAL, caps.LOCAL, caps.SOFTCAP,
                            caps.GQA, caps.VARLEN, caps.SEQUSED, caps.PACK_GQA,
                            caps.DETERMINISTIC, caps.DROPOUT, caps.APPEND, caps.MODS,
                            caps.BLOCK_SPARSE, caps.FP8}),
    dtypes=("bf16", "fp16", "e4m3 / e5m2 (forward)"),
    head_dims=tuple(sorted(SUPPORTED_HDIMS)),
    backward_head_dims=tuple(sorted(BWD_SUPPORTED_HDIMS)),
    fp8_head_dims=FP8_SUPPORTED_HDIMS,
    decode=("split-KV", "paged K/V (pages of a power of two from 8 rows read in the kernel)",
            "new K/V appended in the kernel"),
    verified="H100 80GB HBM3, 2026-12-06",
)
