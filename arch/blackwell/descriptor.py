"""The blackwell pipeline's descriptor: sm100a code (tcgen05 MMAs, tensor memory, TMA; the
backward's pair of CTAs with cta_group::2), forward and backward, compile-verified only: it
is not in dispatch's default order until it has run on Blackwell hardware, and runs when
named (arch="blackwell") or allowed by FLASH_CUTE_ALLOW_UNTESTED=blackwell. Its capabilities
hold in both directions (pack_gqa: the backward runs unpacked)."""

from flash_cute.contract import descriptor as caps
from flash_cute.contract.descriptor import Descriptor

from .config import BWD_HDIMS, SUPPORTED_HDIMS

BLACKWELL = Descriptor(
    name="blackwell",
    majors=range(10, 11),
    capabilities=frozenset({caps.FORWARD, caps.BACKWARD, caps.CAUSAL, caps.LOCAL, caps.SOFTCAP,
                            caps.GQA, caps.VARLEN, caps.SEQUSED, caps.PACK_GQA,
                            caps.DETERMINISTIC, caps.MODS, caps.BLOCK_SPARSE}),
    hardware_tested=False,
    head_dims=SUPPORTED_HDIMS,
    backward_head_dims=BWD_HDIMS,
)
