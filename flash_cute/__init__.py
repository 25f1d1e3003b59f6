"""flash-cute: exact FlashAttention in CuTe DSL for Ampere, Hopper and Blackwell."""

from flash_cute.variants.block_mask import create_block_mask
from flash_cute.api.combine import flash_attn_combine
from flash_cute.api.interface import check_inputs, flash_attn_func, flash_attn_varlen_func
from flash_cute.api.kvcache import flash_attn_with_kvcache
from flash_cute.reference.attention import attention_ref

__version__ = "0.1.0"
__all__ = ["attention_ref", "check_inputs", "create_block_mask", "flash_attn_combine",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
