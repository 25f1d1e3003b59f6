"""The local attention of a ring step: one rank's queries against one K/V block, at the
global positions both hold, returning a partial (O, LSE) to be merged with the other
blocks' by their LSE, and the partial gradients of the backward.

A ring step's mask is a band in global positions (causal: k ≤ q; a window: q − left ≤ k ≤
q + right), and both sides of a step are runs of positions with one stride (contiguous and
zigzag: stride 1, in one or two runs; striped: stride w). `band_call` turns each pair of
runs into a call of the ordinary operators: a band in local indices j − i ∈ [lo, hi] is the
operators' bottom-right-aligned window once the rows or columns that the band leaves empty
are trimmed, so no kernel needs a diagonal offset argument (docs/decisions.md, D-CP-BANDS).

Two implementations, one interface (`forward`, `backward`, `partial_dtype`):

* `Float64Local`: exact, dense float64 at explicit positions; score and mask mods
  (FlexAttention's form) see global positions. What the tests run inside the ring.
* `OperatorLocal`: `torch.ops.flash_cute.fwd` / `bwd` on each pair of runs, asking for
  float32 partial outputs (`partial_out`) and float32 gradients (`grads_fp32`), so nothing
  is rounded to 16 bits between ring steps. The CPU operator has both; the CUDA kernels'
  are not exposed yet (the operators say so).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch


class Rows(NamedTuple):
    """Where a tensor's rows sit: `pos`, each row's position in its sequence (int64
    [rows]); `doc`, each row's document for packed documents (None: a padded batch, whose
    sequences are the batch entries)."""
    pos: torch.Tensor
    doc: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Spec:
    """What every ring step shares: the softmax scale, the band in global positions
    (`left` / `right`: None unbounded; causal is right = 0), the softcap, and the
    FlexAttention-form mods (score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q_idx,
    kv_idx)), called with global positions and global heads (`head_offset`: the first
    query head this rank holds, under Ulysses)."""
    softmax_scale: float
    left: Optional[int] = None
    right: Optional[int] = None
    softcap: float = 0.0
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    head_offset: int = 0
    # Dropout: the keep decisions of `flash_cute.reference.rng` at global (batch or
    # document, head, query, key) coordinates, from one seed every rank shares; `heads`:
    # the call's query heads (b · heads + h numbers a head's stream).
    dropout_p: float = 0.0
    seed: int = 0
    heads: int = 0


def spec_of(head_dim: int, softmax_scale=None, causal=False, window_size=(-1, -1),
            softcap=0.0, score_mod=None, mask_mod=None) -> Spec:
    """A `Spec` from `flash_attn_func`'s arguments (window sides < 0: unbounded)."""
    left, right = (None if w is None or w < 0 else int(w) for w in window_size)
    if causal:
        right = 0
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return Spec(float(scale), left, right, float(softcap), score_mod, mask_mod)


def _band_mask(qr: Rows, kr: Rows, spec: Spec):
    """bool [sq, sk]: the band of `spec` at these global positions, inside one document."""
    diff = kr.pos[None, :] - qr.pos[:, None]
    visible = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    if spec.left is not None:
        visible &= diff >= -spec.left
    if spec.right is not None:
        visible &= diff <= spec.right
    if qr.doc is not None:
        visible &= qr.doc[:, None] == kr.doc[None, :]
    return visible


class Float64Local:
    """The exact local attention: float64, dense, at explicit positions."""

    partial_dtype = torch.float64

    def _scores(self, q, k, qr: Rows, kr: Rows, spec: Spec):
        """(scores [b, h, sq, sk] after scale, softcap and score mod; mask [b|1, h|1, sq, sk]).
        The mods' b is the batch entry, or for packed documents the query's document."""
        group = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2))
        s = s * spec.softmax_scale
        if spec.softcap > 0:
            s = spec.softcap * torch.tanh(s / spec.softcap)
        mask = _band_mask(qr, kr, spec)[None, None]
        b, h = s.shape[:2]
        batch = torch.arange(b, device=s.device)[:, None, None, None] if qr.doc is None else \
            qr.doc.to(s.device)[None, None, :, None]
        grids = (batch, torch.arange(h, device=s.device)[None, :, None, None] + spec.head_offset,
                 qr.pos.to(s.device)[None, None, :, None],
                 kr.pos.to(s.device)[None, None, None, :])
        if spec.score_mod is not None:
            s = torch.broadcast_to(spec.score_mod(s, *grids), s.shape)
        if spec.mask_mod is not None:
            mask = mask & torch.broadcast_to(spec.mask_mod(*grids), s.shape).bool()
        return s, mask, grids

    def _dropped(self, p, grids, spec: Spec):
        """P with dropout's decisions at global coordinates applied, kept values scaled by
        1 / (1 − p_drop); P itself without dropout."""
        if not spec.dropout_p:
            return p
        from flash_cute.reference.rng import keep_threshold, random16

        batch, head, q_idx, kv_idx = grids
        bits = random16(torch.tensor([spec.seed]), (batch * spec.heads + head).cpu(),
                        q_idx.cpu(), kv_idx.cpu()).to(p.device)
        keep = bits < keep_threshold(spec.dropout_p)
        return torch.where(keep, p / (1.0 - spec.dropout_p), 0.0)

    def forward(self, q, k, v, qr: Rows, kr: Rows, spec: Spec):
        """(O float64 [b, sq, h, dv], LSE float64 [b, h, sq]); a row with no visible key:
        O = 0, LSE = −inf."""
        q, k, v = (t.double() for t in (q, k, v))
        s, mask, grids = self._scores(q, k, qr, kr, spec)
        s = s.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        p = self._dropped(p, grids, spec)
        group = q.shape[2] // k.shape[2]
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(group, dim=2))
        return out, lse

    def backward(self, dout, delta, q, k, v, lse, qr: Rows, kr: Rows, spec: Spec):
        """(dQ, dK, dV) float64 of this block's share, with P = exp(S − lse) from the whole
        row's `lse` and `delta` = rowsum(dO ∘ O) − dLSE [b, h, sq] of the merged output (as
        the kernels take them)."""
        dout = dout.double()
        q, k, v = (t.detach().double() for t in (q, k, v))
        group = q.shape[2] // k.shape[2]
        with torch.enable_grad():
            q.requires_grad_(True)
            k.requires_grad_(True)
            s, mask, grids = self._scores(q, k, qr, kr, spec)
            finite = mask & torch.isfinite(lse)[..., None]
            safe_lse = torch.where(torch.isinf(lse), 0.0, lse)[..., None]
            p = torch.where(finite, torch.exp(s.detach() - safe_lse), 0.0)
            # With dropout: dV = (P∘Z)ᵀ dO and dS = P ∘ (dO Vᵀ ∘ Z − Δ), Z the scaled keeps.
            pz = self._dropped(p, grids, spec)
            v_rep = v.repeat_interleave(group, dim=2)
            dv = torch.einsum("bhqk,bqhd->bkhd", pz, dout)
            dp = torch.einsum("bqhd,bkhd->bhqk", dout, v_rep)
            zp = self._dropped(torch.ones_like(p), grids, spec) if spec.dropout_p else 1.0
            ds = p * (dp * zp - delta[..., None])
            dq, dk = torch.autograd.grad(s, (q, k), ds)
        b, sk, hk = k.shape[:3]
        dv = dv.view(b, sk, hk, group, -1).sum(3)
        return dq, dk, dv


class LocalAttention(torch.autograd.Function):
    """A local attention (`local.forward` / `backward`) as an autograd function."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, spec, local):
        out, lse = local.forward(q, k, v, q_pos, k_pos, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pos, ctx.spec, ctx.local = (q_pos, k_pos), spec, local
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        pd = ctx.local.partial_dtype
        delta = (dout.to(pd) * out).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse.to(pd)
        dq, dk, dv = ctx.local.backward(dout, delta, q, k, v, lse, *ctx.pos, ctx.spec)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@dataclass(frozen=True)
class Run:
    """A run of positions of one document (`doc`, −1 in a padded batch): local rows
    [start, start + length) hold positions first + stride · i."""
    start: int
    length: int
    first: int
    stride: int
    doc: int = -1


def runs_of(rows: Rows) -> list:
    """The rows as maximal runs of one stride inside one document, taken greedily from the
    first row: a run's stride is its first step, and it extends while the steps keep it
    (the ring's layouts give one run (contiguous, striped) or two (zigzag) per document).
    The steps' stretches of one value are found on tensors, so the walk costs a few steps
    per run, not one per row."""
    pos = rows.pos.cpu()
    n = pos.numel()
    if n == 0:
        return []
    doc = None if rows.doc is None else rows.doc.cpu()
    steps = pos[1:] - pos[:-1]
    joined = torch.ones_like(steps, dtype=torch.bool) if doc is None else doc[1:] == doc[:-1]
    # last[i]: the last step of the stretch of equal, joined steps that step i is in.
    new = torch.ones_like(joined)
    new[1:] = (steps[1:] != steps[:-1]) | ~joined[1:] | ~joined[:-1]
    firsts = torch.nonzero(new).flatten()
    ends = torch.cat([firsts[1:] - 1, torch.tensor([n - 2])])
    last = ends[torch.cumsum(new.long(), 0) - 1]
    runs, start = [], 0
    while start < n:
        first, owner = int(pos[start]), -1 if doc is None else int(doc[start])
        if start == n - 1 or not bool(joined[start]):
            runs.append(Run(start, 1, first, 1, owner))
            start += 1
            continue
        end = int(last[start])  # the run takes steps start..end, rows start..end + 1
        runs.append(Run(start, end - start + 2, first, int(steps[start]), owner))
        start = end + 2
    return runs


def band_calls(qr: Rows, kr: Rows, spec: Spec) -> list:
    """The operator calls of a block: one per pair of runs of one document that the band
    leaves visible."""
    calls = []
    key_runs = runs_of(kr)
    for a in runs_of(qr):
        for b in key_runs:
            if a.doc != b.doc:
                continue
            for a1, b1 in _common_stride(a, b):
                call = band_call(a1, b1, spec)
                if call is not None:
                    calls.append(call)
    return calls


def _common_stride(a: Run, b: Run) -> list:
    """Pairs of runs with one stride covering a x b: the pair itself, or, where the strides
    differ (short zigzag chunks: positions 0 and 3 read as one run of stride 3), the shorter
    run cut into single rows, which take any stride."""
    if a.stride == b.stride or min(a.length, b.length) == 1:
        return [(a, b)]
    if a.length <= b.length:
        return [(Run(a.start + i, 1, a.first + i * a.stride, b.stride, a.doc), b)
                for i in range(a.length)]
    return [(a, Run(b.start + j, 1, b.first + j * b.stride, a.stride, b.doc))
            for j in range(b.length)]


@dataclass(frozen=True)
class BandCall:
    """One operator call for a pair of runs: query rows [q0, q1) against key rows
    [k0, k1) of the runs' tensors, with the operators' window (left, right; None
    unbounded) in their bottom-right alignment. `None` from `band_call`: no pair visible."""
    q0: int
    q1: int
    k0: int
    k1: int
    left: Optional[int]
    right: Optional[int]
    # Global coordinates of the call's row 0 and its stride, for mods: position of query
    # row i = q_first + stride · i (keys alike); the document (−1 padded).
    q_first: int = 0
    k_first: int = 0
    stride: int = 1
    doc: int = -1


def band_call(qr: Run, kr: Run, spec: Spec) -> Optional[BandCall]:
    """The operator call that computes the band of `spec` between two runs of one stride t:
    with positions a + t·i and c + t·j, q − left ≤ k ≤ q + right is j − i ∈ [lo, hi], lo =
    ceil((−left − (c − a)) / t), hi = floor((right − (c − a)) / t). The operators' window
    is j − i ∈ [D − L, D + R] with D = sk − sq: when D > hi the last D − hi key rows are
    seen by no query and are dropped, when D < lo the last lo − D query rows see no key
    and are dropped (O = 0, LSE = −inf); then R = hi − D, L = D − lo."""
    if qr.stride != kr.stride and min(qr.length, kr.length) > 1:
        raise ValueError("a ring step's query and key runs must share their stride")
    t = qr.stride if qr.length > 1 else kr.stride
    n, m, shift = qr.length, kr.length, kr.first - qr.first
    lo = None if spec.left is None else -((spec.left + shift) // t)    # ceil((-left-shift)/t)
    hi = None if spec.right is None else (spec.right - shift) // t
    if (lo is not None and lo > m - 1) or (hi is not None and hi < -(n - 1)) or \
            (lo is not None and hi is not None and lo > hi):
        return None
    if lo is not None and lo <= -(n - 1):
        lo = None           # the band's left edge lies outside the block
    if hi is not None and hi >= m - 1:
        hi = None
    d = m - n
    if hi is not None and d > hi:
        m, d = m - (d - hi), hi
    if lo is not None and d < lo:
        n, d = n - (lo - d), lo
    if n <= 0 or m <= 0:
        return None
    return BandCall(qr.start, qr.start + n, kr.start, kr.start + m,
                    None if lo is None else d - lo, None if hi is None else hi - d,
                    qr.first, kr.first, t, qr.doc)


class OperatorLocal:
    """The library's operators inside the ring, one call per visible pair of runs, the
    pairs of one query run merged by their LSE, in float32. Mods and dropout see global
    coordinates: the mods through `GlobalMods`, dropout through a framed seed."""

    partial_dtype = torch.float32

    def _options(self, spec: Spec, call: BandCall):
        window = tuple(-1 if w is None else w for w in (call.left, call.right))
        return (None, None, spec.softmax_scale, False, *window, spec.softcap, None, False, None)

    def _dropout(self, spec: Spec, call: BandCall, device) -> tuple:
        """(dropout_p, rng_seed) of a call: the ring's seed framed at the call's global
        coordinates (`rng.framed_seed`), so the kernels draw single-process attention's
        decisions."""
        if not spec.dropout_p:
            return 0.0, None
        from flash_cute.reference.rng import framed_seed

        seed = framed_seed(torch.tensor([spec.seed], dtype=torch.int64), call.q_first,
                           call.k_first, call.stride, spec.head_offset, max(call.doc, 0),
                           heads=spec.heads)
        if torch.device(device).type == "cuda":
            # From pinned memory, without waiting for the device's queue.
            seed = seed.pin_memory().to(device, non_blocking=True)
        return spec.dropout_p, seed

    def _variant(self, spec: Spec, call: BandCall) -> int:
        """The registry key of the call's mods at global coordinates (0 without mods)."""
        if spec.score_mod is None and spec.mask_mod is None:
            return 0
        mods = global_mods(spec.score_mod, spec.mask_mod)
        mods.offsets.copy_(torch.tensor([call.q_first, call.k_first, call.stride,
                                         spec.head_offset, max(call.doc, 0)]))
        return mods.key

    def forward(self, q, k, v, qr: Rows, kr: Rows, spec: Spec):
        b, sq, h = q.shape[:3]
        out = torch.zeros(b, sq, h, v.shape[3], dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, sq), -math.inf, dtype=torch.float32, device=q.device)
        for call in band_calls(qr, kr, spec):
            o, l_ = torch.ops.flash_cute.fwd(
                q[:, call.q0:call.q1], k[:, call.k0:call.k1], v[:, call.k0:call.k1],
                None, None, None, None, *self._options(spec, call), False,
                self._variant(spec, call), *self._dropout(spec, call, q.device), 1, None, None,
                True)
            rows = slice(call.q0, call.q1)
            out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], o, l_)
        return out, lse

    def backward(self, dout, delta, q, k, v, lse, qr: Rows, kr: Rows, spec: Spec):
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                      for t in (q, k, v))
        # The operator takes Δ as rowsum(dO ∘ O) − dLSE: an O of one column holding Δ and
        # dO of ones there give it (dO itself is what P·dV needs, so it goes in dout).
        for call in band_calls(qr, kr, spec):
            rows, cols = slice(call.q0, call.q1), slice(call.k0, call.k1)
            out_eq, dlse = _delta_as_out(dout[:, rows], delta[:, :, rows])
            g = torch.ops.flash_cute.bwd(
                dout[:, rows], dlse, q[:, rows], k[:, cols], v[:, cols], out_eq,
                lse[:, :, rows].float().contiguous(), None, None, None, None,
                *self._options(spec, call), self._variant(spec, call),
                *self._dropout(spec, call, q.device), False, True)
            dq[:, rows] += g[0]
            dk[:, cols] += g[1]
            dv[:, cols] += g[2]
        return dq, dk, dv


class GlobalMods:
    """A user's FlexAttention-form mods called at global coordinates from inside an operator
    call: one wrapper per mod pair, registered once, its offsets a captured int64 tensor
    (query row 0's position, key row 0's, the stride, the head offset, the document) that
    each call sets before it runs, so the traced graph and its key stay the same."""

    def __init__(self, score_mod, mask_mod):
        from flash_cute.variants import registry

        self.offsets = offsets = torch.zeros(5, dtype=torch.int64)

        def where(b, h, q_idx, kv_idx):
            # The tracer reads captured tensors through index expressions only.
            at = lambda n: offsets[q_idx * 0 + n]  # noqa: E731
            return b + at(4), h + at(3), at(0) + at(2) * q_idx, at(1) + at(2) * kv_idx

        def score(s, b, h, q_idx, kv_idx):
            return score_mod(s, *where(b, h, q_idx, kv_idx))

        def mask(b, h, q_idx, kv_idx):
            return mask_mod(*where(b, h, q_idx, kv_idx))

        self.key = registry.register(None if score_mod is None else score,
                                     None if mask_mod is None else mask)


@functools.lru_cache(maxsize=64)
def global_mods(score_mod, mask_mod) -> GlobalMods:
    """The `GlobalMods` of a mod pair (one per pair, kept: its registry entry lives as long)."""
    return GlobalMods(score_mod, mask_mod)


def _delta_as_out(dout, delta):
    """(out, dlse) such that the operator's rowsum(dO ∘ out) − dlse equals `delta`: out =
    0 and dlse = −delta (the operator reads out only through that sum)."""
    return torch.zeros_like(dout), (-delta).float().contiguous()


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial softmaxes merged by their LSE (out [b, s, h, d], lse [b, h, s]), in the
    dtype of `out_a`; rows that saw no key in either stay O = 0, LSE = −inf."""
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    wa = torch.where(torch.isinf(lse_a), 0.0, torch.exp(lse_a - safe)).transpose(1, 2)
    wb = torch.where(torch.isinf(lse_b), 0.0, torch.exp(lse_b.to(lse_a.dtype) - safe))
    wb = wb.transpose(1, 2)
    out = out_a * wa[..., None] + out_b.to(out_a.dtype) * wb[..., None]
    return out, lse
