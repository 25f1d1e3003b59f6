"""The dropped-rows status word: how many appended K/V rows did not fit their cache.

An append (`flash_attn_with_kvcache` with k / v) writes sequence b's new rows at positions
``cache_seqlens[b] ...``; rows whose position falls outside ``[0, capacity)``, or whose
block_table entry (cache_batch_idx entry) is not one of the cache, are dropped, in the torch
path and in the kernel, never written over a cached row. Reading `cache_seqlens`
on the host to refuse such a call would cost a device sync per decode step and break CUDA
graph capture, so each append instead adds its dropped rows to a per-device int64 counter
with one torch operation (no sync, captured by CUDA graphs, traced by torch.compile).
`check_status` reads and clears it (one sync, when the caller chooses) and raises
`CacheOverflowError` if rows were dropped.
"""

from __future__ import annotations

import torch


class CacheOverflowError(RuntimeError):
    """Appended K/V rows were dropped because their cache had no room for them."""


# device -> int64 [1]: rows dropped since the last `check_status`.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counter(device: torch.device) -> torch.Tensor:
    """The device's counter, made on first use. Under CUDA graph capture a new one would be
    zeroed by every replay (the fill is captured too): an eager call first makes it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _COUNTERS.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the dropped-rows counter of flash_attn_with_kvcache's appends "
                               f"does not exist yet on {device}: run one append (or "
                               "flash_cute.check_status()) eagerly before capturing a graph")
        found = _COUNTERS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return found


def count_dropped(fits: torch.Tensor) -> None:
    """Add an append's dropped rows (False entries of `fits`, `paging.append_fits`) to its
    device's counter: one in-place add, no sync."""
    if fits.numel():
        counter(fits.device).add_((~fits).sum())


def check_status(device=None, *, raise_error: bool = True) -> int:
    """Read and clear the dropped-rows counter of `device` (default: the current CUDA device,
    or the CPU without CUDA), one device sync. Returns the rows dropped since the last call;
    with `raise_error` (the default) raises `CacheOverflowError` instead when there were any.
    Call it where a sync is cheap (after a decode loop, between steps of a scheduler).

    Args:
        device: the device whose counter to read (default: the current CUDA device, or the
            CPU without CUDA).
        raise_error: raise when rows were dropped (default), instead of returning the count.

    Returns:
        The rows dropped since the last call (0 when none, or any count without
        `raise_error`).

    Raises:
        CacheOverflowError: rows were dropped, with `raise_error`.
        RuntimeError: called during CUDA graph capture (it reads the counter on the host)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check_status reads the counter on the host: call it outside "
                           "CUDA graph capture")
    count = counter(device)
    dropped = int(count.item())
    count.zero_()
    if dropped and raise_error:
        raise CacheOverflowError(
            f"{dropped} appended K/V row(s) did not fit their cache (cache_seqlens + new "
            f"tokens past its capacity, a negative cache_seqlens, or a block_table / "
            f"cache_batch_idx entry outside the cache) and were dropped; the cached rows "
            f"are unchanged. flash_cute.check_inputs(True) names the sequence")
    return dropped
