"""The blackwell pipeline's descriptor: sm100a code (tcgen05 MMAs, tensor memory, TMA), forward
only and compile-verified: it is not in dispatch's default order until it has run on
Blackwell hardware, and runs when named (arch="blackwell") or allowed by
FLASH_CUTE_ALLOW_UNTESTED=blackwell."""

from flash_cute.contract import descriptor as caps
from flash_cute.contract.descriptor import Descriptor

from .config import SUPPORTED_HDIMS

BLACKWELL = Descriptor(
    name="blackwell",
    majors=range(10, 11),
    capabilities=frozenset({caps.FORWARD, caps.CAUSAL, caps.LOCAL, caps.SOFTCAP, caps.GQA,
                            caps.VARLEN, caps.SEQUSED, caps.PACK_GQA, caps.MODS,
                            caps.BLOCK_SPARSE}),
    hardware_tested=False,
    head_dims=SUPPORTED_HDIMS,
)
