"""Reading index tensors' contents: `cu_seqlens` and `seqused` (a device sync on CUDA, so
only with the content check on, `flash_cute.check_inputs`; always on the CPU), checked against
the tensors they index and the max_seqlen promises."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flash_cute.runtime.checks import is_fake


def _should_read(t, force: bool) -> bool:
    # Reading a CUDA tensor from the host syncs the device; only do it on request. A fake
    # tensor (a trace) has no values to read.
    if t is None or is_fake(t):
        return False
    return t.device.type == "cpu" or (force and t.device.type == "cuda")


def check_seqlen_contents(
    q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_q, max_k, *, force: bool
) -> None:
    """Value checks on cu_seqlens_* / seqused_* (CPU tensors, or CUDA when forced)."""
    for side, x, cu, used, max_len in (
        ("q", q, cu_seqlens_q, seqused_q, max_q),
        ("k", k, cu_seqlens_k, seqused_k, max_k),
    ):
        lengths, source = _used_lengths(side, x, cu, used, force)
        if lengths is not None:
            _check_max_covers(f"max_seqlen_{side}", max_len, lengths, source)


def _used_lengths(side, x, cu, used, force) -> tuple[list[int] | None, str]:
    """The per-sequence lengths the kernels use (seqused where given, else the spans) and
    where they come from, or None when a tensor that decides them is not read."""
    spans, source = None, ""
    if cu is not None:
        offsets = _packed_offsets(f"cu_seqlens_{side}", cu, x.shape[0], force)
        if offsets is not None:
            spans = [b - a for a, b in zip(offsets, offsets[1:])]
            source = f"cu_seqlens_{side}={offsets}"
    elif used is not None:
        spans = [x.shape[1]] * used.shape[0]  # padded: every sequence holds seqlen slots
    if used is None:
        return spans, source
    if not _should_read(used, force):
        return None, ""
    lengths = used.tolist()
    if spans is not None:
        _check_seqused_values(f"seqused_{side}", lengths, spans)
    return lengths, f"seqused_{side}={lengths}"


def _packed_offsets(name, cu, total, force) -> list[int] | None:
    """Check cumulative offsets; return them, or None if not read."""
    if not _should_read(cu, force):
        return None
    offsets = cu.tolist()
    if offsets[0] != 0:
        # flash_attn's convention (a cumulative sum with a leading 0); a nonzero start is
        # almost always an off-by-one (cu_seqlens[1:] passed), so it is refused (D-CU0).
        raise ValueError(f"{name}[0] must be 0 (cu_seqlens are cumulative lengths starting at "
                         f"0), got {name}={offsets}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing (it holds cumulative sequence lengths), but "
                f"{name}[{i}]={offsets[i]} < {name}[{i - 1}]={offsets[i - 1]}; got {name}={offsets}"
            )
    if offsets[-1] > total:
        raise ValueError(
            f"{name}[-1]={offsets[-1]} exceeds the {total} tokens packed in dim 0 of the "
            f"{name[-1]} tensor; got {name}={offsets}"
        )
    return offsets


def _check_max_covers(max_name: str, max_len: int, lengths: list[int], source: str) -> None:
    """max_seqlen sizes the grid: a longer sequence would lose its excess tokens."""
    longest = max(lengths, default=0)
    if longest > max_len:
        raise ValueError(
            f"{max_name}={max_len} is smaller than the longest sequence "
            f"(length {longest}, batch index {lengths.index(longest)}) in {source}; "
            f"the kernel would skip the excess tokens"
        )


def _check_seqused_values(name: str, used: list[int], capacity: Iterable[int]) -> None:
    for b, (n, cap) in enumerate(zip(used, capacity)):
        if not 0 <= n <= cap:
            raise ValueError(
                f"{name}[{b}]={n} must be in [0, {cap}] (the tokens sequence {b} holds); "
                f"got {name}={used}"
            )


def check_index_contents(q, k, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                         seqused_k=None, max_seqlen_q=None, max_seqlen_k=None) -> None:
    """The content check of one call (`flash_cute.check_inputs`): the values of its index
    tensors, read to the host in one transfer (one device sync), against the rules
    `validate_attention_inputs(check_contents=True)` applies — cu_seqlens start at 0, do not
    decrease and end inside the tensor; seqused[b] lies in [0, span of sequence b]; max_seqlen
    covers the longest used length. Raises ValueError naming the tensor and the entry."""
    named = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if t is not None]
    if not named:
        return
    flat = torch.cat([t.reshape(-1) for t in named]).cpu() if len(named) > 1 else \
        named[0].reshape(-1).cpu()
    host, at = [], 0
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if t is None:
            host.append(None)
            continue
        host.append(flat[at:at + t.numel()])
        at += t.numel()
    varlen = cu_seqlens_q is not None
    max_q = max_seqlen_q if varlen else q.shape[1]
    max_k = max_seqlen_k if varlen else k.shape[1]
    check_seqlen_contents(q, k, *host, max_q, max_k, force=False)
