"""flash-cute: exact FlashAttention in CuTe DSL for Ampere, Hopper and Blackwell.

The public surface is this module's names, `flash_cute.flash_attn_interface` (flash_attn 2's
functions), `flash_cute.integrations`, the mod examples (`flash_cute.variants.examples`,
FlexAttention's form; `flash_cute.blocks.fa4_mod_examples`, FA4's form) and the operators
`torch.ops.flash_cute.*`. `docs/architecture.md` maps the package's layers.
"""

from flash_cute import _aliases
from flash_cute.api.combine import flash_attn_combine
from flash_cute.api.interface import check_inputs, flash_attn_func, flash_attn_varlen_func
from flash_cute.api.kvcache import flash_attn_with_kvcache
from flash_cute.reference.attention import attention_ref
from flash_cute.runtime.plans import clear_plans
from flash_cute.runtime.status import CacheOverflowError, check_status
from flash_cute.variants.block_mask import create_block_mask
from flash_cute.variants.registry import register as register_mods
from flash_cute.variants.tracer import UnsupportedMod

_aliases.install()

__version__ = "0.1.0"
__all__ = ["CacheOverflowError", "UnsupportedMod", "attention_ref", "check_inputs",
           "check_status", "clear_plans", "create_block_mask", "flash_attn_combine",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "register_mods"]
