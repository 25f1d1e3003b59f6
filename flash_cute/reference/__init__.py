"""The reference (torch): float64/float32 attention, the bf16/fp16 baseline of the tolerance
rule, and plain-PyTorch models of the kernels' blocks.

`flash_cute.reference.attention_ref` and the other names of `reference.attention` are kept
here, where users have always imported them."""

from flash_cute.reference.attention import *  # noqa: F401,F403
from flash_cute.reference.attention import __all__  # noqa: F401
