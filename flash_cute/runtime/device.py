"""The GPU facts the host path asks on every call, asked of torch once per device."""

import functools

import torch


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple:
    """torch.cuda.get_device_capability(index), cached: torch's query costs ~20 µs, and every
    attention call needs it (the pipeline choice and the compile key's arch)."""
    return torch.cuda.get_device_capability(index)


def capability_of(device: torch.device) -> tuple:
    """The compute capability of `device` (a CUDA device; index None: the current one)."""
    return device_capability(device.index if device.index is not None
                             else torch.cuda.current_device())
