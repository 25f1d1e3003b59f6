"""The reference (torch): float64/float32 attention, the bf16/fp16 baseline of the tolerance
rule, and plain-PyTorch models of the kernels' blocks (`reference.block_models`).

Every public name `reference.attention` defines (`attention_ref`, `attention_ref_backward`,
`tolerance_check`, `Window`, ...) is kept here too, where users have always imported them."""

from flash_cute.reference.attention import *  # noqa: F403
from flash_cute.reference.attention import (  # noqa: F401  (public, outside its __all__)
    Window,
    __all__,
    attention_ref_backward,
)
