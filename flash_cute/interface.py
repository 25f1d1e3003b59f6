"""Public API: `flash_attn_func` and `flash_attn_varlen_func`, with flash_attn.cute's names,
layouts and return convention ``(out, lse)``; autograd; the plan cache.

Which pipeline runs a call is `flash_cute.dispatch`'s choice (the newest that runs on the
device and has the capabilities the problem needs); ``arch=`` forces one (e.g.
``arch="ampere"`` runs the sm80 pipeline on a Hopper GPU, for per-arch comparison), which then
refuses, before any launch, what it lacks.
"""

import contextlib
import os
import threading
from collections import OrderedDict
from typing import NamedTuple, Optional, Tuple

import torch

from flash_cute.dispatch import check_capabilities, select_backward_pipeline, select_pipeline
from flash_cute.pipeline import Pipeline, required_capabilities
from flash_cute.validation import (AttentionProblem, check_index_contents,
                                   validate_attention_inputs, validate_backward_inputs)


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, plan: "_Plan"):
        out, lse = plan.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *lengths = ctx.saved_tensors
        plan = ctx.plan
        dout = _kernel_ready(torch.zeros_like(out) if dout is None else dout)
        # dlse is None unless the loss used the LSE (grads are not materialized).
        dlse = None if dlse is None else dlse.contiguous()
        # q, k, v, out and lse are the forward's, fixed by the plan: only the incoming
        # gradients tell this plan's backward calls apart.
        key = _call_key((dout, dlse), ())
        launch = plan.backwards.get(key)
        if launch is None:
            validate_backward_inputs(dout, q, k, v, out, lse, plan.problem)
            launch = plan.bwd_pipeline.plan_backward(dout, dlse, q, k, v, out, lse, plan.problem,
                                                     *lengths, plan.deterministic)
            plan.backwards.put(key, launch)
        with _on_device(q):
            dq, dk, dv = launch(dout, dlse, q, k, v, out, lse, *lengths)
        return _not_differentiable(dq, dk, dv) + (None,) * 5


def _not_differentiable(*grads) -> tuple:
    """The gradients, which under create_graph=True raise when differentiated again: the
    backward kernels have no derivative of their own, and gradients that merely came back
    without a graph would make a second-order term (a gradient penalty) silently zero.
    `once_differentiable` does this only when the incoming gradients require grad, which
    they seldom do; here it depends on the saved inputs, as SDPA's flash backward does."""
    if not torch.is_grad_enabled():
        return grads
    err = torch._C._functions.DelayedError(
        b"flash-cute's attention backward is not differentiable (no second-order gradients)",
        len(grads))
    return err(*(g.detach().requires_grad_() for g in grads))


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (autograd may hand over expanded or offset gradients)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
    *,
    arch: Optional[str] = None,
):
    """Exact attention on [batch, seqlen, nheads, hdim] tensors; returns ``(out, lse)``.

    The parameters are flash_attn.cute's (flash-attn 4.0.0b36), in its order, so positional
    calls work too; `arch` (keyword-only) is flash-cute's own. Those with no kernel here yet
    (qv, gathered K/V, sinks, score/mask mods, aux tensors, block sparsity, num_splits > 1)
    raise NotImplementedError naming the feature; num_splits 1 or below (FA4's "choose")
    runs unsplit.

    ``lse`` is [batch, nheads, seqlen_q] fp32 (natural log), ``None`` unless `return_lse` or a
    backward pass needs it. Masks are bottom-right aligned; ``window_size=(left, right)`` with
    None (or a negative int) for an unbounded side; GQA/MQA when k/v have fewer heads.

    ``pack_gqa`` (GQA/MQA forward): tile the query heads that share a K/V head together, so
    short query sequences (decode) fill a tile and K/V are read once per group. None lets the
    pipeline decide (`flash_cute.launch.packed_heads`); True requires it (NotImplementedError
    where the pipeline cannot: the ampere pipeline, or a group that does not divide the
    hopper tile's 128 rows); False never packs. The result is the same either way.
    """
    if (qv is not None or gather_kv_indices is not None or learnable_sink is not None
            or num_splits > 1 or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors is not None or aux_scalars is not None
            or block_sparse_tensors is not None or block_sparse_tensors_bwd is not None
            or gather_bwd_recompute_p or gather_bwd_token_chunk is not None):
        _refuse_unbuilt(locals())

    def validate():
        return validate_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap,
                                         pack_gqa=pack_gqa)

    options = ("padded", softmax_scale, causal, window_size, softcap, deterministic, arch,
               pack_gqa)
    return _run(q, k, v, (None, None, None, None), validate, options, arch, deterministic,
                return_lse)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse: bool = False,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
    *,
    arch: Optional[str] = None,
):
    """Attention over sequences of different lengths; returns ``(out, lse)``.

    The parameters are flash_attn.cute's, in its order (the fourth is `qv`: pass cu_seqlens
    by keyword or after it), as in `flash_attn_func`; `min_seqlen_k` and
    `disable_scheduler_metadata` are scheduling hints, accepted and not needed here; a
    page_table, scheduler_metadata or seqlen_k_per_split raises NotImplementedError.

    Layouts (flash_attn.cute's):

    * packed: q [total_q, nheads, hdim], k/v [total_k, nheads_kv, d], int32 cu_seqlens_q and
      cu_seqlens_k [batch + 1] and max_seqlen_q/k (at least the longest length used); lse
      [nheads, total_q].
    * padded: cu_seqlens_q = cu_seqlens_k = None, q/k/v [batch, seqlen, heads, d] as in
      `flash_attn_func` (max_seqlen_* omitted or equal to the padded lengths); lse
      [batch, nheads, seqlen_q]. With seqused_k this is e.g. a padded KV cache.

    ``seqused_q`` / ``seqused_k`` (optional int32 CUDA [batch], either layout, independently):
    sequence b uses only its first seqused[b] queries / keys of its span (cu_seqlens[b] to
    cu_seqlens[b + 1], or the padded length); the rest is padding that is never read. Their
    values should lie in [0, span] and be at most max_seqlen. Index contents are not read on
    the host (that needs a device sync) unless `check_inputs` is on; the kernels clamp them to
    the tensors instead, so bad values give meaningless results but no fault
    (docs/reliability.md). Causal and local masks align bottom-right to the *used* lengths. Query rows
    past seqused_q[b] get out = 0 and lse = -inf, as a row that sees no key (flash-attn leaves
    them unwritten, so any value there meets its contract), and dq = 0; keys past seqused_k[b]
    get dk = dv = 0. ``pack_gqa`` as in `flash_attn_func`.

    Not supported (NotImplementedError before any launch): packed q with padded k/v or the
    reverse (cu_seqlens for one side only).
    """
    if (qv is not None or gather_kv_indices is not None or page_table is not None
            or learnable_sink is not None or num_splits > 1 or score_mod is not None
            or score_mod_bwd is not None or mask_mod is not None or aux_tensors is not None
            or aux_scalars is not None or block_sparse_tensors is not None
            or scheduler_metadata is not None or seqlen_k_per_split is not None
            or gather_bwd_recompute_p or gather_bwd_token_chunk is not None):
        _refuse_unbuilt(locals())

    def validate():
        return validate_attention_inputs(
            q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, pack_gqa=pack_gqa,
        )

    options = ("varlen", max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
               softcap, deterministic, arch, pack_gqa)
    return _run(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), validate, options,
                arch, deterministic, return_lse)


# flash_attn.cute's parameters with no kernel here yet, and what brings them (NotImplementedError
# names them; they never raise TypeError, so FA4 code runs up to the feature it needs).
_UNBUILT = {
    "qv": "MLA's qv operand", "gather_kv_indices": "gathered K/V (top-k attention)",
    "page_table": "paged KV (the decode issue)", "learnable_sink": "attention sinks",
    "num_splits": "num_splits > 1, split-KV (the decode issue)",
    "score_mod": "score_mod (the variants issue)", "score_mod_bwd": "score_mod_bwd (variants)",
    "mask_mod": "mask_mod (the variants issue)", "aux_tensors": "aux_tensors (variants)",
    "aux_scalars": "aux_scalars (variants)", "block_sparse_tensors": "block sparsity",
    "block_sparse_tensors_bwd": "block sparsity", "scheduler_metadata": "scheduler_metadata",
    "seqlen_k_per_split": "seqlen_k_per_split (split-KV)",
    "gather_bwd_recompute_p": "gather_bwd_recompute_p", "gather_bwd_token_chunk":
    "gather_bwd_token_chunk",
}


def _refuse_unbuilt(args: dict) -> None:
    for name, what in _UNBUILT.items():
        value = args.get(name)
        given = value > 1 if name == "num_splits" else (value is not None and value is not False)
        if given:
            raise NotImplementedError(f"{name}: {what} is not built in flash-cute yet")


class _Plan(NamedTuple):
    """What validation and dispatch decide for a call, and its forward launch."""
    problem: AttentionProblem
    pipeline: Pipeline
    bwd_pipeline: Optional[Pipeline]  # None when no gradient is needed
    deterministic: bool
    launch: object  # the pipeline's `plan_forward` for the call (a `launch.ForwardLaunch`)
    backwards: "_BoundedCache"  # its backward launches, by the incoming gradients' `_call_key`


class _BoundedCache:
    """At most `size` entries, the least recently used forgotten first; safe to use from
    several threads (DataParallel, the autograd engine's one thread per device, a threaded
    server). A None key (a call without one) is never stored or found."""

    def __init__(self, size: int):
        self.size = size
        self._entries = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        if key is None:
            return None
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key, value):
        if key is None:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self):
        return len(self._entries)

    def clear(self):
        with self._lock:
            self._entries.clear()


# Calls already validated, dispatched and planned, by `_call_key`: a repeated call skips
# validation, pipeline selection, the support checks and the launch's set-up, and only
# allocates and launches (host time decides short calls: `bench latency`). Each key holds
# everything those read; each plan holds its backward's launches (`_Plan.backwards`).
_PLANS = _BoundedCache(256)


# The opt-in content check (`check_inputs`), from FLASH_CUTE_CHECK_INPUTS=1 at import.
_CHECK_INPUTS = [os.environ.get("FLASH_CUTE_CHECK_INPUTS", "0") not in ("", "0")]


def check_inputs(on: bool = True) -> bool:
    """Check the *contents* of every call's cu_seqlens and seqused (non-decreasing from 0,
    ending inside the tensor; seqused within each sequence's span; max_seqlen covering the
    longest sequence), raising ValueError that names the tensor and the entry. Off by default
    (also `FLASH_CUTE_CHECK_INPUTS=1`): it reads them to the host, one device sync per call,
    which breaks CUDA graph capture and stalls the launch queue. Turn it on while developing
    a serving or packing path, or to find which batch feeds bad indices; with it off, bad
    contents never make a kernel touch memory outside its tensors (`flash_cute.seqlen`), but
    give meaningless values. Returns the previous setting."""
    previous, _CHECK_INPUTS[0] = _CHECK_INPUTS[0], bool(on)
    return previous


def clear_plans() -> None:
    """Forget every planned call (the next call of each is validated and planned again)."""
    _PLANS.clear()


_PLAIN = frozenset({type(None), bool, int, float, str, tuple})


def _call_key(tensors: tuple, options: tuple) -> Optional[tuple]:
    """A key of a call's tensors and other arguments, or None (then the call is validated
    every time).

    Of each tensor, what validation and dispatch read (they never read values of CUDA
    tensors): dtype, device, shape, strides, address modulo 16 bytes, requires_grad; a tensor
    subclass (e.g. FakeTensor under torch.compile) or a non-tensor gets no key. `options`:
    plain values, and tuples of them (window_size), kept with their types (True and 1
    validate differently but compare equal); anything else (a tensor, a list) gets no key."""
    types = tuple(map(type, options))
    if not _PLAIN.issuperset(types):
        return None
    for o in options:
        if type(o) is tuple:
            inner = tuple(map(type, o))
            if tuple in inner or not _PLAIN.issuperset(inner):
                return None
            types += inner
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return None
    try:
        signature = tuple([None if t is None else (t.dtype, t.device, t.shape, t.stride(),
                                                   t.data_ptr() & 15, t.requires_grad)
                           for t in tensors])
    except RuntimeError:
        # A tensor without storage (sparse, ...): validation says what is wrong with it.
        return None
    return signature, options, types, torch.is_grad_enabled()


def _make_plan(q, k, v, lengths: tuple, problem, arch, deterministic) -> _Plan:
    pipeline = select_pipeline(q.device, arch, problem)
    check_capabilities(pipeline, required_capabilities(problem))
    pipeline.check_supported(problem, q.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    bwd_pipeline = None
    if needs_grad:
        bwd_pipeline = select_backward_pipeline(q.device, pipeline, problem, deterministic)
        bwd_pipeline.check_supported(problem, q.device, backward=True)
    with torch.cuda.device(q.device):
        launch = pipeline.plan_forward(q, k, v, problem, *lengths)
    return _Plan(problem, pipeline, bwd_pipeline, bool(deterministic), launch, _BoundedCache(8))


def _run(q, k, v, lengths: tuple, validate, options: tuple, arch, deterministic, return_lse):
    """`lengths`: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), each a tensor or None;
    `validate()` returns the call's `AttentionProblem` or raises; `options`: the call's other
    arguments, for the plan's key."""
    key = _call_key((q, k, v) + lengths, options)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k, v, lengths, validate(), arch, deterministic)
        _PLANS.put(key, plan)
    if _CHECK_INPUTS[0] and lengths != (None, None, None, None):
        # Contents change from call to call under the same key: checked every call.
        check_index_contents(q, k, *lengths, plan.problem.max_seqlen_q,
                             plan.problem.max_seqlen_k)
    # Kernels launch on the current device and stream: make that q's device.
    with _on_device(q):
        if plan.bwd_pipeline is None:
            out, lse = plan.launch(q, k, v, *lengths)
        else:
            out, lse = _FlashAttnFunc.apply(q, k, v, *lengths, plan)
    return out, (lse if (return_lse or plan.bwd_pipeline is not None) else None)


_SAME_DEVICE = contextlib.nullcontext()


def _on_device(t: torch.Tensor):
    """`torch.cuda.device(t.device)`, or nothing to do when it is current already (the
    common case, for a few microseconds less per call)."""
    index = t.get_device()
    if index >= 0 and index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(t.device)
