"""Plain-PyTorch reference attention, the ground truth for every kernel test.

Conventions (identical to flash-attn / ``flash_attn.cute``):

* Layouts: ``q`` [batch, seqlen_q, nheads, hdim], ``k`` [batch, seqlen_k,
  nheads_kv, hdim], ``v`` [batch, seqlen_k, nheads_kv, hdim_v]. Varlen drops
  the batch dimension (``q`` [total_q, nheads, hdim]) and describes the
  sequences with int32 prefix sums ``cu_seqlens_q`` / ``cu_seqlens_k``.
* GQA/MQA: query head ``h`` reads kv head ``h // (nheads // nheads_kv)``.
* ``scores = (q . k) * softmax_scale``; with ``softcap > 0`` they become
  ``softcap * tanh(scores / softcap)``. LSE is the natural-log logsumexp of
  these final scores over the visible keys.
* Masks are bottom-right aligned: with ``off = seqlen_k - seqlen_q``, key ``j``
  is visible to query ``i`` iff ``i + off - left <= j <= i + off + right``
  (``window_size = (left, right)``, ``None`` = unbounded) and ``j < seqlen_k``.
  ``causal=True`` means ``right = 0``.
* A query row that sees no key has ``O = 0`` and ``LSE = -inf``; gradients
  through it are 0.
* ``seqused_q`` / ``seqused_k`` (int32 ``[batch]``, either layout): sequence
  ``b`` is only the first ``seqused[b]`` rows of its span; masks align to these
  used lengths, query rows past them get ``O = 0`` and ``LSE = -inf``, and rows
  past them (queries or keys) get zero gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "attention_mask",
    "attention_ref",
    "normalize_window",
    "score_attention_ref",
    "tolerance_check",
    "ToleranceResult",
]

Window = Tuple[Optional[int], Optional[int]]

_MODES = ("float64", "float32", "native")


def normalize_window(causal: bool, window_size: Window = (None, None)) -> Window:
    """Return ``(left, right)`` with ``None`` for an unbounded side.

    Negative ints mean unbounded (flash-attn's ``-1`` convention). ``causal``
    forces ``right = 0`` (as flash-attn does) and keeps any left window.
    """
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair, got {window_size!r}")
    left, right = (None if w is None or w < 0 else int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


def attention_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: Window = (None, None),
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """Bool ``[seqlen_q, seqlen_k]`` tensor, True where key ``j`` is visible to query ``i``.

    Bottom-right aligned: query ``i`` sits at key position ``i + seqlen_k - seqlen_q``.
    """
    left, right = normalize_window(causal, window_size)
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left is not None:
        visible &= j >= diag - left
    if right is not None:
        visible &= j <= diag + right
    return visible


def _softmax_rows(scores: torch.Tensor, mask: torch.Tensor):
    """Masked softmax along the last dim: returns (P, LSE) with the -inf conventions.

    Masked scores are replaced by -inf *before* the exp (never ``where`` after
    it), so no inf/NaN can leak into the backward pass. The row max is a pure
    numerical shift, so it is detached: LSE and P do not depend on it.
    """
    if scores.shape[-1] == 0:  # no keys at all (amax over an empty dim is an error)
        return scores, scores.new_full(scores.shape[:-1], -math.inf)
    scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    # A fully masked row has max -inf; shifting by 0 keeps exp(-inf) = 0, not NaN.
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    safe_sum = torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse = torch.where(empty, torch.full_like(row_sum, -math.inf), row_max + torch.log(safe_sum))
    return p / safe_sum, lse.squeeze(-1)


def _probs(scores, softmax_scale, causal, window_size, softcap, variant=None, batch_index=0):
    """Scale, softcap (or the score mod), mask (and the mask mod) and softmax raw scores
    [..., seqlen_q, seqlen_k] -> (P, LSE)."""
    scores = scores * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mask = attention_mask(scores.shape[-2], scores.shape[-1], causal, window_size,
                          device=scores.device)
    if variant is not None:
        scores, mask = _apply_mods(variant, scores, mask, batch_index)
    return _softmax_rows(scores, mask)


def _mod_grids(scores, batch_index):
    from flash_cute.variants.tracer import index_grids

    grids = index_grids(batch_index, scores.shape[1], scores.shape[2], scores.shape[3],
                        device=scores.device)
    # The used lengths of the sequence(s) at hand (built-in mods align to them).
    return dict(grids, seqlen_q=scores.shape[2], seqlen_k=scores.shape[3])


def _apply_mods(variant, scores, mask, batch_index):
    """A `registry.CallMods`'s score and mask mods on [b, h, sq, sk] scaled scores."""
    if getattr(variant, "fa4", None) is not None:
        raise NotImplementedError("FA4-form (@cute.jit) mods run in the GPU kernels only; on "
                                  "CPU tensors write them in FlexAttention's form")
    from flash_cute.variants.tracer import evaluate

    grids = _mod_grids(scores, batch_index)
    if variant.score_mod is not None:
        aux = tuple(t.to(scores.device) for t in variant.score_mod.aux)
        modded = evaluate(variant.score_mod, {"score": scores, **grids}, aux)
        scores = torch.broadcast_to(modded, scores.shape).to(scores.dtype)
    keep = True
    if variant.mask_mod is not None:
        aux = tuple(t.to(scores.device) for t in variant.mask_mod.aux)
        keep = torch.broadcast_to(evaluate(variant.mask_mod, grids, aux), scores.shape).bool()
    if variant.block_states is not None:
        from flash_cute.variants.block_mask import element_mask

        states = variant.block_states.to(scores.device)
        if states.shape[0] > 1:
            states = states[batch_index if isinstance(batch_index, list) else [batch_index]]
        keep = element_mask(states, variant.block_size, scores.shape[2], scores.shape[3], keep)
    if keep is not True:
        mask = mask & keep
    return scores, mask


def _mode_dtypes(mode: str, input_dtype: torch.dtype):
    """(matmul/out dtype, softmax/LSE dtype) of a reference mode."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "float64":
        return torch.float64, torch.float64
    # native: both matmuls run in the input dtype, as a PyTorch implementation would.
    return (torch.float32 if mode == "float32" else input_dtype), torch.float32


def _dropped(p, dropout, batch_index):
    """P with dropout's decisions (`flash_cute.reference.rng`: the kernels' draws) applied and kept
    values scaled by 1 / (1 - p); P itself without dropout (None)."""
    if dropout is None:
        return p
    from flash_cute.reference.rng import keep_mask

    prob, seed = dropout
    keep = keep_mask(seed.cpu(), prob, batch_index, p.shape[1], p.shape[2], p.shape[3],
                     device="cpu").to(p.device)
    return torch.where(keep, p / (1.0 - prob), torch.zeros((), dtype=p.dtype, device=p.device))


def _attention_dense(q, k, v, softmax_scale, causal, window_size, softcap, mode, variant=None,
                     dropout=None, batch_index=None):
    """Batched attention for one set of equal-length sequences (layout [b, s, h, d]);
    `batch_index`: the mods' (and dropout's) b of each entry (default 0..b-1)."""
    mm_dtype, score_dtype = _mode_dtypes(mode, q.dtype)
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(mm_dtype), k.to(mm_dtype))
    batch_index = list(range(q.shape[0])) if batch_index is None else batch_index
    p, lse = _probs(scores.to(score_dtype), softmax_scale, causal, window_size, softcap, variant,
                    batch_index)
    p = _dropped(p, dropout, batch_index)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(mm_dtype), v.to(mm_dtype))
    return out, lse


def score_attention_ref(
    scores: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    mode: str = "float64",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over a given raw score matrix: ``softmax(mask(softcap(S * scale))) V``.

    ``scores`` [batch, seqlen_q, seqlen_k] stands in for Q K^T (the reference of
    the score-attention block test); ``v`` [batch, seqlen_k, hdim_v]. Returns
    ``out`` [batch, seqlen_q, hdim_v] and ``lse`` [batch, seqlen_q]. Modes as in
    :func:`attention_ref`; in ``"native"`` mode the scores are taken as given
    (float32) and P and the PV matmul use ``v``'s dtype.
    """
    if (scores.dim() != 3 or v.dim() != 3 or scores.shape[0] != v.shape[0]
            or scores.shape[2] != v.shape[1]):
        raise ValueError(f"bad shapes: scores {tuple(scores.shape)}, v {tuple(v.shape)}")
    mm_dtype, score_dtype = _mode_dtypes(mode, v.dtype)
    p, lse = _probs(scores.to(score_dtype), softmax_scale, causal, window_size, softcap)
    return p.to(mm_dtype) @ v.to(mm_dtype), lse


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """Raise ValueError on inconsistent shapes; return True for varlen inputs."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    ndim = 3 if varlen else 4
    if not (q.dim() == k.dim() == v.dim() == ndim):
        raise ValueError(f"q, k, v must all be {ndim}-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q hdim {q.shape[-1]} != k hdim {k.shape[-1]}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q {q.shape[0]}, k {k.shape[0]}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads {nheads} must be a multiple of nheads_kv {nheads_kv}")
    if varlen:
        for name, cu, total in (("q", cu_seqlens_q, q.shape[0]), ("k", cu_seqlens_k, k.shape[0])):
            # Rows past cu_seqlens[-1] belong to no sequence (as in the kernels): queries
            # there get O = 0 and LSE = -inf, keys there are never read.
            if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) > total:
                raise ValueError(f"cu_seqlens_{name} must be 1-D prefix sums from 0 to at "
                                 f"most {total}")
            if bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"cu_seqlens_{name} must be non-decreasing")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    return varlen


def _used_lengths(name: str, used: Optional[torch.Tensor], spans: list) -> list:
    """The used length of each span: seqused (each entry in [0, its span]) or the span."""
    if used is None:
        return spans
    if used.dim() != 1 or used.numel() != len(spans):
        raise ValueError(f"{name} must be 1-D with one entry per sequence ({len(spans)})")
    values = used.tolist()
    for b, (n, span) in enumerate(zip(values, spans)):
        if not 0 <= n <= span:
            raise ValueError(f"{name}[{b}]={n} must be in [0, {span}]")
    return values


def _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """Per sequence b: (b, used query rows, used key rows, unused query rows of its span)."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    spans_q = [b - a for a, b in zip(bounds_q, bounds_q[1:])]
    spans_k = [b - a for a, b in zip(bounds_k, bounds_k[1:])]
    used_q = _used_lengths("seqused_q", seqused_q, spans_q)
    used_k = _used_lengths("seqused_k", seqused_k, spans_k)
    for b in range(len(spans_q)):
        yield (b, slice(bounds_q[b], bounds_q[b] + used_q[b]),
               slice(bounds_k[b], bounds_k[b] + used_k[b]), spans_q[b] - used_q[b])


def _uniform_cu(batch: int, seqlen: int) -> torch.Tensor:
    """cu_seqlens of `batch` sequences of `seqlen` rows (a padded layout seen as packed)."""
    return torch.arange(batch + 1, dtype=torch.int32) * seqlen


def _attention_used(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, args):
    """Varlen attention over the used rows of each span; the span's other query rows get
    O = 0 and LSE = -inf (built from constants, so no gradient reaches their q, k, v)."""
    outs, lses = [], []
    for b, sq, sk, pad in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        out, lse = _attention_dense(q[None, sq], k[None, sk], v[None, sk], *args,
                                    batch_index=[b])
        outs += [out[0], out.new_zeros(pad, *out.shape[2:])]
        lses += [lse[0], lse.new_full((lse.shape[1], pad), -math.inf)]
    tail = q.shape[0] - int(cu_seqlens_q[-1])
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs.append(torch.zeros(tail, q.shape[1], v.shape[-1], dtype=outs[0].dtype if outs else
                            q.dtype, device=q.device))
    lses.append(torch.full((q.shape[1], tail), -math.inf, dtype=lses[0].dtype if lses else
                           dtype, device=q.device))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _padded_as_varlen(q, k, v, seqused_q, seqused_k, args):
    """Padded inputs with seqused: each batch entry is one span of the padded length."""
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    out, lse = _attention_used(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                               _uniform_cu(batch, sq), _uniform_cu(batch, sk), seqused_q,
                               seqused_k, args)
    return out.unflatten(0, (batch, sq)), lse.unflatten(1, (batch, sq)).transpose(0, 1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    mode: str = "float64",
    variant=None,
    dropout=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference attention; returns ``(out, lse)``. Differentiable through autograd.

    ``variant``: a `registry.CallMods` (traced score and mask mods), applied to the scaled
    scores (b: the batch entry or sequence; q_idx, kv_idx: positions inside it).
    ``dropout``: (p, rng_seed): the attention weights dropped by the decisions the kernels
    draw from that seed (`flash_cute.reference.rng`), kept ones scaled by 1 / (1 - p); the LSE is
    the undropped softmax's.

    Modes:

    * ``"float64"``: everything upcast to float64 (the exact answer); out and
      lse are float64.
    * ``"float32"``: the same computation in float32.
    * ``"native"``: bf16/fp16 "as PyTorch would do it", the baseline of the
      FlashAttention tolerance rule: QK^T in the input dtype, scale / softcap /
      mask / softmax in float32, P cast to the input dtype, PV in the input
      dtype. out has the input dtype, lse is float32.

    Shapes: ``out`` [batch, seqlen_q, nheads, hdim_v], ``lse`` [batch, nheads,
    seqlen_q]; varlen: ``out`` [total_q, nheads, hdim_v], ``lse`` [nheads, total_q].
    ``seqused_q`` / ``seqused_k``: see the module docstring.

    Args:
        q: [batch, seqlen_q, nheads, hdim]; varlen [total_q, nheads, hdim].
        k: [batch, seqlen_k, nheads_kv, hdim] (nheads_kv dividing nheads); varlen
            [total_k, nheads_kv, hdim].
        v: like k, with head dim hdim_v.
        softmax_scale: the scores' scale (default 1 / sqrt(hdim)).
        causal: the causal mask, aligned bottom-right.
        window_size: (left, right), None for an unbounded side.
        softcap: > 0: cap · tanh(S / cap) of the scaled scores.
        cu_seqlens_q: int32 [batch + 1] (varlen; with cu_seqlens_k).
        cu_seqlens_k: int32 [batch + 1].
        seqused_q: int32 [batch], query rows used per sequence.
        seqused_k: int32 [batch], key rows used per sequence.
        mode: "float64" (default), "float32" or "native" (above).
        variant: traced mods (above), or None.
        dropout: (p, rng_seed), or None.

    Returns:
        (out, lse), shaped as above.

    Raises:
        ValueError: an unknown mode; q, k and v of different ranks, batches or head dims;
            one of cu_seqlens_q / cu_seqlens_k without the other.
    """
    _mode_dtypes(mode, q.dtype)  # validates mode
    varlen = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    args = (softmax_scale, causal, window_size, softcap, mode, variant, dropout)
    if varlen:
        return _attention_used(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, args)
    if seqused_q is None and seqused_k is None:
        return _attention_dense(q, k, v, *args)
    return _padded_as_varlen(q, k, v, seqused_q, seqused_k, args)


def attention_ref_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor] = None,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    variant=None,
    dropout=None,
    aux_grads: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`attention_ref` by the written-out formulas (no autograd), in
    `dtype`, for the same arguments plus the incoming gradients of out and (optionally) lse:
    ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP − Δ)`` with ``Δ = rowsum(dO ∘ O) − dLSE``,
    through the softcap's ``1 − tanh²``, then ``dQ = dS K · scale`` and ``dK = dSᵀ Q · scale``
    (summed over each K/V head's query heads). It runs where autograd does not (inside an
    operator's kernel under a dispatch mode), and checks the kernels' formula against
    autograd of the forward. `aux_grads` ({id(tensor): zeroed tensor of its shape}): the
    gradients of a score mod's learnable captured tensors (`derivative.learnable`) are added
    there. `out` and `lse` (given together): the forward's, which the backward then takes
    as the kernels do, P = exp(S·scale − lse) and Δ = rowsum(dO ∘ out) − dLSE, instead of
    recomputing them from these keys; with a forward over more keys than `k` (a ring's other
    ranks'), the result is these keys' share of the gradients."""
    varlen = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if (out is None) != (lse is None):
        raise ValueError("out and lse are given together (the forward's saved state) or not")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    args = (softmax_scale, causal, window_size, softcap, variant, dropout, aux_grads)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    dlse = None if dlse is None else dlse.to(dtype)
    saved = None if out is None else (out.to(dtype), lse.to(dtype))
    if not varlen and seqused_q is None and seqused_k is None:
        return _backward_dense(q, k, v, dout, dlse, *args, saved=saved)
    if not varlen:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        flat = [t.flatten(0, 1) for t in (q, k, v, dout)]

        def rows(t):   # [b, h, sq] -> [h, b * sq]
            return None if t is None else t.transpose(0, 1).flatten(1, 2)
        flat_saved = None if saved is None else (saved[0].flatten(0, 1), rows(saved[1]))
        grads = _backward_used(*flat, rows(dlse), _uniform_cu(batch, sq),
                               _uniform_cu(batch, sk), seqused_q, seqused_k, args,
                               saved=flat_saved)
        return tuple(g.unflatten(0, (batch, n)) for g, n in zip(grads, (sq, sk, sk)))
    return _backward_used(q, k, v, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                          seqused_k, args, saved=saved)


def _backward_dense(q, k, v, dout, dlse, softmax_scale, causal, window_size, softcap,
                    variant=None, dropout=None, aux_grads=None, batch_index=None, saved=None):
    """The backward of `_attention_dense` ([b, s, h, d]; dlse [b, h, sq] or None); a score
    mod's derivative comes from its graph (`derivative.score_derivative`). With dropout,
    P̃ = Z ∘ P / (1 - p): dV = P̃ᵀ dO, dP = Z ∘ (dO Vᵀ) / (1 - p), dS = P ∘ (dP − Δ).
    `saved` (out [b, sq, h, dv], lse [b, h, sq]): the forward's, as the kernels take them:
    P = exp(S − lse) and Δ = rowsum(dO ∘ out), so that keys the forward saw beyond these
    (another rank's, in a ring) count in P's normalization."""
    hk = k.shape[2]
    group = q.shape[2] // hk
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, kk) * softmax_scale
    capped = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    mask = attention_mask(raw.shape[-2], raw.shape[-1], causal, window_size, device=raw.device)
    batch_index = list(range(q.shape[0])) if batch_index is None else batch_index
    scores = capped
    if variant is not None:
        # The mods take the capped scores; the softcap's derivative is at its own output.
        scores, mask = _apply_mods(variant, capped, mask, batch_index)
    if saved is None:
        p, _ = _softmax_rows(scores, mask)
    else:
        p = _probs_from_lse(scores, mask, saved[1].to(scores.dtype))
    p_dropped = _dropped(p, dropout, batch_index)
    out = torch.einsum("bhqk,bkhd->bqhd", p_dropped, vv) if saved is None else \
        saved[0].to(dout.dtype)
    delta = (dout * out).sum(-1).transpose(1, 2)  # [b, h, sq]
    if dlse is not None:
        delta = delta - dlse
    dp = _dropped(torch.einsum("bqhd,bkhd->bhqk", dout, vv), dropout, batch_index)
    ds = p * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1 - (capped / softcap) ** 2)
    if aux_grads and variant is not None and variant.score_mod is not None:
        from flash_cute.variants.derivative import accumulate_load_grads

        accumulate_load_grads(variant.score_mod,
                              {"score": capped, **_mod_grids(raw, batch_index)}, ds, aux_grads)
    if variant is not None and variant.score_mod is not None:
        ds = ds * _mod_derivative(variant.score_mod, capped, batch_index)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * softmax_scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p_dropped, dout)
    return dq, dk.unflatten(2, (hk, group)).sum(3), dv.unflatten(2, (hk, group)).sum(3)


def _probs_from_lse(scores, mask, lse):
    """P = exp(S − lse) where the mask keeps a score (0 elsewhere, and on rows whose lse is
    −inf: they saw no key)."""
    finite = torch.isfinite(lse)[..., None]
    shifted = scores - torch.where(finite, lse[..., None], torch.zeros_like(lse[..., None]))
    return torch.where(mask & finite, torch.exp(shifted.masked_fill(~mask, 0.0)),
                       torch.zeros((), dtype=scores.dtype, device=scores.device))


def _mod_derivative(graph, raw, batch_index):
    """d(score_mod)/d(score) at the scaled scores `raw` [b, h, sq, sk]."""
    from flash_cute.variants.derivative import score_derivative
    from flash_cute.variants.tracer import evaluate

    aux = tuple(t.to(raw.device) for t in graph.aux)
    grad = evaluate(score_derivative(graph), {"score": raw, **_mod_grids(raw, batch_index)}, aux)
    return torch.broadcast_to(torch.as_tensor(grad, dtype=raw.dtype, device=raw.device),
                              raw.shape)


def _backward_used(q, k, v, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   args, saved=None):
    """The backward of `_attention_used` (packed layout; dlse and saved's lse [h, total_q]
    or None): rows outside the used part of each span get zero gradients."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, sq, sk, _ in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        seq_dlse = None if dlse is None else dlse[None, :, sq]
        seq_saved = None if saved is None else (saved[0][None, sq], saved[1][None, :, sq])
        grads = _backward_dense(q[None, sq], k[None, sk], v[None, sk], dout[None, sq], seq_dlse,
                                *args, batch_index=[b], saved=seq_saved)
        dq[sq], dk[sk], dv[sk] = (g[0] for g in grads)
    return dq, dk, dv


class ToleranceResult(NamedTuple):
    """Outcome of :func:`tolerance_check`: ``ok`` plus both errors for reporting."""

    ok: bool
    err: float
    err_native: float
    atol: float


def _rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attn's ``fwd_atol``: twice the rounding granularity of ``dtype`` near 0.3."""
    r = ref.to(dtype)
    return 2.0 * float(((r + 0.3 - 0.3) - r).abs().max()) if r.numel() else 0.0


def tolerance_check(
    out: torch.Tensor,
    out_ref64: torch.Tensor,
    out_native: torch.Tensor,
    *,
    factor: float = 2.0,
    atol: Optional[float] = None,
) -> ToleranceResult:
    """The FlashAttention accuracy rule: ``err <= factor * err_native + atol``.

    ``err = max|out - out_ref64|`` and ``err_native = max|out_native - out_ref64|``
    (both in float64). Works for outputs, LSE and gradients:

    * any NaN in ``out`` fails;
    * where ``out_ref64`` is -inf (LSE of fully masked rows), ``out`` must be
      exactly -inf too; those positions are then left out of both errors;
    * ``atol=None`` uses flash-attn's rounding allowance, twice the rounding
      granularity of ``out``'s dtype at the reference's values.
    """
    if not (out.shape == out_ref64.shape == out_native.shape):
        raise ValueError(
            f"shape mismatch: {tuple(out.shape)}, {tuple(out_ref64.shape)}, "
            f"{tuple(out_native.shape)}"
        )
    ours, ref, native = (t.detach().to(torch.float64) for t in (out, out_ref64, out_native))
    if atol is None:
        atol = _rounding_atol(out_ref64.detach().masked_fill(torch.isinf(ref), 0), out.dtype)
    ref_neg_inf = torch.isneginf(ref)
    keep = ~ref_neg_inf
    err = _max_abs(ours[keep] - ref[keep])
    err_native = _max_abs(native[keep] - ref[keep])
    ok = (
        not bool(torch.isnan(ours).any())
        and bool(torch.isneginf(ours[ref_neg_inf]).all())
        and err <= factor * err_native + atol
    )
    return ToleranceResult(ok, err, err_native, atol)


def _max_abs(diff: torch.Tensor) -> float:
    """max |diff|, 0 for an empty tensor, NaN propagated."""
    if diff.numel() == 0:
        return 0.0
    return float(diff.abs().max())
