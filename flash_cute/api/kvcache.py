"""`flash_attn_with_kvcache`: flash_attn 2's decode entry point, with its signature and
semantics, on flash-cute's attention.

One call, in this order:

1. the new keys and values `k`, `v` (if given) are rotated (`rotary_cos` / `rotary_sin`,
   interleaved or GPT-NeoX halves) and written *in place* into the cache at rows
   ``cache_seqlens[b] ...`` of cache entry ``cache_batch_idx[b]`` (or through `block_table`,
   paged);
2. q is rotated: at positions ``cache_seqlens[b] + i`` when causal or local, all at
   ``cache_seqlens[b]`` otherwise;
3. attention of q over the cache rows ``cache_leftpad[b] ... cache_seqlens[b] + seqlen_new``
   (the appended tokens included, bottom-right causal), GQA as usual.

Where the attention kernel can (the hopper pipeline on eager CUDA calls with no gradient, no
local window, no cache_batch_idx / cache_leftpad), step 1's write is the kernel's own: each
query tile writes the new rows among the keys it reads before reading them
(`flash_cute.blocks.kv_append`, `interface.attend_and_append`); rotary is then torch operations on
the new rows and q only. Elsewhere (torch.compile, the CPU, the ampere pipeline, small pages
the kernel does not read) the writes are torch operations before the kernel (no host sync:
CUDA-graph safe). Without cache_batch_idx or cache_leftpad the cache is read in place, dense
or through block_table (`flash_attn_varlen_func`'s page_table), its used rows seqused_k;
those two still gather the used rows with torch operations first. ``num_splits`` is
split-KV's (default 0: the heuristic, as in flash_attn 2; `flash_cute.runtime.splits`).
Index contents are checked before anything is written on CPU tensors, and on CUDA ones with
`flash_cute.check_inputs(True)` (`flash_cute.runtime.cache_contents`). Otherwise they are
clamped into the cache and page table (never read or written outside them), and an appended
row that does not fit (its position outside the capacity, its page or cache entry not one of
the cache) is dropped, never written over a cached row, and counted in the status word that
`flash_cute.check_status()` reads (docs/guide/reliability.md). alibi_slopes runs where
flash-cute's mods run (CPU tensors for now)."""

from typing import Optional, Union

import torch

from flash_cute.api.interface import _eager, attend_and_append, flash_attn_varlen_func
from flash_cute.api.params import document
from flash_cute.runtime import paging, plans, status
from flash_cute.runtime.cache_contents import check_cache_contents
from flash_cute.runtime.checks import is_fake

# Whether the attention kernel itself writes the appended k / v into the cache where it can
# (`_kernel_appends`); off, torch operations write them first (tests compare the two).
APPEND_IN_KERNEL = True


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, q_descale=None, k_descale=None,
                            v_descale=None, out_dtype=None):
    """q [b, sq, h, d]; k_cache / v_cache [b_cache, s_cache, h_kv, d] or, with block_table
    (int32 [b, max_pages]), paged [num_pages, page_size, h_kv, d]; k / v [b, s_new, h_kv, d];
    cache_seqlens int or int32 [b]; returns out [b, sq, h, d] (and lse [b, h, sq] with
    return_softmax_lse). See the module docstring.

    FP8 (FA3's keywords): float8_e4m3fn q and caches with ``q_descale`` / ``k_descale`` /
    ``v_descale`` (float32 [b, h_kv]) read the cache with the FP8 forward, O in ``out_dtype``
    (bf16 unless torch.float16); appending new rows (k, v), rotary and cache_batch_idx /
    cache_leftpad are the 16-bit path's only."""
    batch, seqlen_q = q.shape[:2]
    paged = block_table is not None
    _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
           block_table)
    attend = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                  softcap=softcap if softcap > 0 else 0.0, num_splits=num_splits,
                  return_lse=return_softmax_lse, alibi_slopes=alibi_slopes)
    fp8 = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
               out_dtype=out_dtype)
    if any(x is not None for x in fp8.values()) or q.dtype in (torch.float8_e4m3fn,
                                                                torch.float8_e5m2):
        if k is not None or rotary_cos is not None or cache_batch_idx is not None \
                or cache_leftpad is not None:
            raise NotImplementedError("the FP8 forward reads the cache only: appending k / v, "
                                      "rotary, cache_batch_idx and cache_leftpad take bf16 or "
                                      "fp16 tensors")
        attend.update(fp8)
    in_place = cache_leftpad is None and cache_batch_idx is None
    if paged:
        attend["page_table"] = block_table
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    local = causal or tuple(window_size) not in ((-1, -1), (None, None))
    _check_contents(q, k_cache, cache_seqlens, new, capacity, local, rotary_cos,
                    cache_batch_idx, cache_leftpad, block_table)
    if in_place and k is None and rotary_cos is None:
        # Nothing to write: the cache is the keys (through its pages), its used rows
        # seqused_k (clamped to the cache by the kernel), with no per-call work on them.
        out, lse = flash_attn_varlen_func(q, k_cache, v_cache,
                                          seqused_k=_used(cache_seqlens, batch, capacity, q,
                                                          paged),
                                          **attend)
        return (out, lse) if return_softmax_lse else out
    seqlens = _lengths(cache_seqlens, batch, k_cache, paged, q.device)
    in_kernel = in_place and k is not None and _kernel_appends(q, k_cache, v_cache, k, v,
                                                               window_size, alibi_slopes)
    fits = None
    if k is not None:
        if rotary_cos is not None:
            positions = seqlens[:, None] + torch.arange(new, device=q.device)
            k = _rotate(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        if not in_kernel:
            # Rows that do not fit are dropped by the torch write below, and counted here;
            # the kernel counts its own (`ForwardLaunch`, `AppendFirst`).
            entry_ok = None if cache_batch_idx is None else \
                (cache_batch_idx >= 0) & (cache_batch_idx < k_cache.shape[0])
            fits = paging.append_fits(seqlens, new, capacity, block_table,
                                      *k_cache.shape[:2], entry_ok=entry_ok)
            status.count_dropped(fits)
    if rotary_cos is not None:
        offsets = torch.arange(seqlen_q, device=q.device) if local else \
            torch.zeros(seqlen_q, dtype=torch.long, device=q.device)
        q = _rotate(q, rotary_cos, rotary_sin, seqlens[:, None] + offsets, rotary_interleaved)
    if in_kernel:
        # The kernel takes the unclamped end of each append: it writes the rows of
        # [cache_seqlens, end) inside the cache and reads the first min(end, capacity).
        out, lse = attend_and_append(
            q, k_cache, v_cache, k.to(k_cache.dtype).contiguous(),
            v.to(v_cache.dtype).contiguous(), (seqlens + new).to(torch.int32), block_table,
            softmax_scale, causal, attend["softcap"], num_splits, return_softmax_lse)
        return (out, lse) if return_softmax_lse else out
    rows = _row_index(batch, k_cache, block_table, cache_batch_idx, q.device)  # [b, capacity]
    if k is not None:
        paging.write_rows(k_cache, v_cache, k, v, rows, seqlens, fits)
    if in_place:
        used = (seqlens + new).clamp(0, capacity).to(torch.int32)
        out, lse = flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=used, **attend)
        return (out, lse) if return_softmax_lse else out
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    start = (torch.zeros_like(seqlens) if cache_leftpad is None else cache_leftpad.long())
    used = ((seqlens + new).clamp(0, capacity) - start).clamp(min=0)
    # Rows leftpad[b] + t of each batch entry, gathered into a padded [b, capacity] view.
    cols = (start[:, None] + torch.arange(rows.shape[1], device=q.device)).clamp(
        0, rows.shape[1] - 1)
    picked = rows.gather(1, cols).flatten()
    keys = k_flat.index_select(0, picked).view(batch, rows.shape[1], *k_cache.shape[2:])
    values = v_flat.index_select(0, picked).view(batch, rows.shape[1], *v_cache.shape[2:])
    attend.pop("page_table", None)
    out, lse = flash_attn_varlen_func(
        q, keys, values, seqused_k=used.clamp(max=rows.shape[1]).to(torch.int32), **attend)
    return (out, lse) if return_softmax_lse else out


def _check_contents(q, k_cache, cache_seqlens, new, capacity, local, rotary_cos, batch_idx,
                    leftpad, block_table) -> None:
    """The call's index contents (`cache_contents.check_cache_contents`), before anything is
    written: on CPU tensors always, on CUDA ones with `check_inputs(True)` (a device sync),
    never while torch.compile traces. An int cache_seqlens is known on the host: checked
    always (with no tensor read)."""
    batch = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = 0 if block_table is not None else capacity
    tensors = [t for t in (cache_seqlens, batch_idx, leftpad, block_table)
               if isinstance(t, torch.Tensor)]
    read = not torch.compiler.is_compiling() and (
        q.device.type == "cpu" or plans.content_check_on()) and not any(map(is_fake, tensors))
    if not read:
        if isinstance(cache_seqlens, torch.Tensor) or torch.compiler.is_compiling():
            return
        # Only what the host knows: the int length, the rotary table's length.
        batch_idx = leftpad = block_table = None
    check_cache_contents(
        cache_seqlens, new, capacity, batch=batch, seqlen_q=q.shape[1], local=local,
        block_table=block_table, num_pages=k_cache.shape[0], page_size=k_cache.shape[1],
        batch_idx=batch_idx, cache_batch=k_cache.shape[0], leftpad=leftpad,
        rotary_rows=None if rotary_cos is None else rotary_cos.shape[0])


# (batch, length, device) -> the int32 seqused_k of an int cache_seqlens (or None: full).
_FULL_LENGTHS: dict = {}


def _used(cache_seqlens, batch, capacity: int, q, paged: bool):
    """seqused_k for a cache read in place: cache_seqlens itself (int32 [b], validated), or
    for an int (None: the whole dense cache, `capacity` rows, or no row of a paged one, as
    `_lengths`) a tensor made once per (batch, length, device)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return _lengths(cache_seqlens, batch, None, False, q.device, convert=False)
    if cache_seqlens is None:
        cache_seqlens = 0 if paged else capacity
    length = min(cache_seqlens, capacity)
    key = (batch, length, q.device)
    used = None if torch.compiler.is_compiling() else _FULL_LENGTHS.get(key)
    if used is None:
        used = torch.full((batch,), max(length, 0), dtype=torch.int32, device=q.device)
        if not torch.compiler.is_compiling():
            if len(_FULL_LENGTHS) > 64:
                _FULL_LENGTHS.clear()
            _FULL_LENGTHS[key] = used
    return used


def _kernel_appends(q, k_cache, v_cache, k, v, window_size, alibi_slopes) -> bool:
    """Whether the attention kernel appends k / v itself (`interface.attend_and_append`):
    eager CUDA calls with no gradient, a query row, no local window (every new row must be
    seen by some query tile, which writes it) and no ALiBi."""
    tensors = (q, k_cache, v_cache, k, v)
    return (APPEND_IN_KERNEL and _eager(*tensors) and q.shape[0] > 0 and q.shape[1] > 0
            and tuple(window_size) in ((-1, -1), (None, None)) and alibi_slopes is None
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _check(q, k_cache, v_cache, k, v, cos, sin, batch_idx, leftpad, block_table) -> None:
    """Shapes and dtypes of the cache-side arguments (the attention validates the rest)."""
    batch = q.shape[0]
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape[:3] + k_cache.shape[3:]:
        raise ValueError(f"q must be [b, s, h, d] and k_cache / v_cache [b_cache, s_cache, h_kv, "
                         f"d] (or [pages, page_size, h_kv, d]), got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(0) != t.shape[1] * t.stride(1) or t.stride(-1) != 1:
            raise ValueError(f"{name} must have its first two dims mergeable and a contiguous "
                             f"last dim (it is written in place), got strides {t.stride()}")
    if (k is None) != (v is None):
        raise ValueError("k and v are given together (the tokens to append) or not at all")
    if k is not None and (k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]
                          or v.shape[:3] != k.shape[:3] or v.shape[3] != v_cache.shape[3]):
        raise ValueError(f"k / v must be [b={batch}, s_new, h_kv, d] like the cache, got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin are given together")
    if cos is not None and (cos.dim() != 2 or sin.shape != cos.shape
                            or 2 * cos.shape[1] > q.shape[-1]):
        raise ValueError(f"rotary_cos / rotary_sin must be [seqlen_ro, rotary_dim / 2] with "
                         f"rotary_dim <= d, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, t, want in (("cache_batch_idx", batch_idx, batch), ("cache_leftpad", leftpad, batch)):
        if t is not None and (t.dtype != torch.int32 or t.shape != (want,)):
            raise ValueError(f"{name} must be int32 [{want}], got {t.dtype} {tuple(t.shape)}")
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 [b={batch}, max_pages], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        if batch_idx is not None:
            raise NotImplementedError("cache_batch_idx with a paged cache (block_table)")


def _lengths(cache_seqlens, batch, k_cache, paged, device, convert=True) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((batch,), 0 if paged else k_cache.shape[1], dtype=torch.long,
                          device=device)
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.long, device=device)
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int or int32 [{batch}], got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    return cache_seqlens.long() if convert else cache_seqlens


def _row_index(batch, k_cache, block_table, batch_idx, device) -> torch.Tensor:
    """[b, capacity]: the flat cache row (of k_cache.flatten(0, 1)) of each sequence's
    position, every index clamped into the cache."""
    if batch_idx is None:
        return paging.cache_rows(k_cache, block_table, batch)
    seq = k_cache.shape[1]
    entry = batch_idx.long().clamp(0, k_cache.shape[0] - 1)
    return entry[:, None] * seq + torch.arange(seq, device=device)


def _rotate(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of x [b, s, h, d] at integer `positions` [b, s] (clamped into the
    tables), on its first 2 · cos.shape[1] dims, in float32."""
    half = cos.shape[1]
    pos = positions.clamp(0, cos.shape[0] - 1).long()
    c, s = (t[pos].float()[:, :, None, :] for t in (cos, sin))  # [b, s, 1, half]
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., 2 * half:]), dim=-1)


document(flash_attn_with_kvcache,
         k="[batch, seqlen_new, nheads_kv, hdim]: new keys written into the cache at "
           "cache_seqlens before attending (None: none).",
         v="like k: the new values.")
