"""Host-side preparation of tensors for TMA descriptors (torch only: no CuTe DSL import)."""

import torch


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of its size-1 dims made compact.

    Validation ignores those strides (the kernel never steps along them), but a TMA descriptor
    encodes every stride and rejects one that is not a multiple of 16 bytes.
    """
    shape, stride = t.shape, t.stride()
    align = 16 // t.element_size()   # elements in 16 bytes (8 for 16-bit, 16 for FP8)
    if all(s % align == 0 or n != 1 for n, s in zip(shape[:-1], stride[:-1])):
        return t
    strides, step = [], 1
    for size, st in reversed(list(zip(shape, stride))):
        strides.append(step if size == 1 else st)
        step = max(step, size * strides[-1])
    return t.as_strided(t.shape, tuple(reversed(strides)))
