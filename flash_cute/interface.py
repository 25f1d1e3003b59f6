"""Public API: `flash_attn_func` and `flash_attn_varlen_func`, with flash_attn.cute's names,
layouts and return convention ``(out, lse)``, and the dispatch to an arch pipeline.

Dispatch picks the newest pipeline that is built and runs on the device; ``arch=`` forces one
(e.g. ``arch="ampere"`` runs the sm80 pipeline on a Hopper GPU, for per-arch comparison). The
backward runs in the forward's pipeline when it has one, else in the newest pipeline with a
backward for the device: the forward's (O, LSE) are the same in every pipeline. A pipeline
that lacks a capability a problem needs (seqused_q / seqused_k, declared by a pipeline's
``SUPPORTS_SEQUSED``; ``pack_gqa=True``, by ``SUPPORTS_PACK_GQA``) is never the default for
it, and refuses it before any launch.
"""

import threading
from collections import OrderedDict
from importlib import import_module
from typing import NamedTuple, Optional, Tuple

import torch

from flash_cute.device import capability_of
from flash_cute.validation import (AttentionProblem, validate_attention_inputs,
                                   validate_backward_inputs)

# Pipelines by name: (compute capability majors it runs on, module with `forward`/`backward`).
# mma.sync and cp.async run on every GPU from sm80 on; WGMMA exists on sm90 only.
PIPELINES = {"ampere": (range(8, 13), "flash_cute.arch.ampere.api"),
             "hopper": (range(9, 10), "flash_cute.arch.hopper.api")}
# Pipelines the dispatcher may pick on its own, newest first. A pipeline still being validated
# is in PIPELINES (reachable with arch=...) but not here.
DEFAULT_ORDER = ("hopper", "ampere")


def select_pipeline(device: torch.device, arch: Optional[str] = None, problem=None) -> str:
    """The pipeline to run on `device`: `arch` if given (and able to run there), else the newest
    that takes `problem` by default (a pipeline's `default_for(problem)`, when it has one)."""
    major = capability_of(device)[0]
    if arch is not None:
        if arch not in PIPELINES:
            built = ", ".join(sorted(PIPELINES))
            raise NotImplementedError(f"arch={arch!r}: no such pipeline is built (built: {built})")
        majors = PIPELINES[arch][0]
        if major not in majors:
            raise ValueError(f"arch={arch!r} runs on compute capability {majors[0]}.x to "
                             f"{majors[-1]}.x; {torch.cuda.get_device_name(device)} is {major}.x")
        return arch
    runs_here = [name for name in DEFAULT_ORDER if major in PIPELINES[name][0]]
    for name in runs_here:
        if _takes_by_default(name, problem):
            return name
    if runs_here and problem is not None:
        # Pipelines run here but lack what the problem asks for: say what.
        check_capabilities(runs_here[0], problem)
    raise NotImplementedError(f"no pipeline runs on compute capability {major}.x")


def _takes_by_default(name: str, problem) -> bool:
    if problem is None:
        return True
    if missing_capability(name, problem) is not None:
        return False
    default_for = getattr(_pipeline_module(name), "default_for", None)
    return default_for is None or default_for(problem)


def missing_capability(name: str, problem) -> Optional[str]:
    """What pipeline `name` lacks to run `problem` at all (None if nothing). A generic check
    here, so a pipeline's own `check_supported` need not know every newer feature."""
    module = _pipeline_module(name)
    uses_seqused = problem.has_seqused_q or problem.has_seqused_k
    if uses_seqused and not getattr(module, "SUPPORTS_SEQUSED", False):
        return "seqused_q/seqused_k"
    packs = problem.pack_gqa and problem.qheads_per_kvhead > 1
    if packs and not getattr(module, "SUPPORTS_PACK_GQA", False):
        return "pack_gqa=True"
    return None


def check_capabilities(name: str, problem) -> None:
    """NotImplementedError, before any launch, when pipeline `name` cannot run `problem`."""
    missing = missing_capability(name, problem)
    if missing is not None:
        takers = [n for n in PIPELINES if missing_capability(n, problem) is None]
        raise NotImplementedError(f"{missing}: not supported by the {name} pipeline yet; "
                                  f"pipelines that support it: {', '.join(takers) or 'none'}")


def select_backward_pipeline(device: torch.device, forward_pipeline: str, problem=None) -> str:
    """The forward's pipeline if it has a backward, else the newest default one that does (and
    can run `problem`, when given)."""
    if hasattr(_pipeline_module(forward_pipeline), "backward"):
        return forward_pipeline
    major = capability_of(device)[0]
    for name in DEFAULT_ORDER:
        if (major in PIPELINES[name][0] and hasattr(_pipeline_module(name), "backward")
                and (problem is None or missing_capability(name, problem) is None)):
            return name
    raise NotImplementedError(f"no pipeline has a backward for compute capability {major}.x")


_MODULES = {}


def _pipeline_module(name: str):
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = import_module(PIPELINES[name][1])
    return module


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                problem: AttentionProblem, pipeline: str, bwd_pipeline: Optional[str],
                deterministic: bool):
        out, lse = _pipeline_module(pipeline).forward(q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                                                      **_seqused_kwargs(seqused_q, seqused_k))
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.problem, ctx.pipeline, ctx.deterministic = problem, bwd_pipeline, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        dout = _kernel_ready(torch.zeros_like(out) if dout is None else dout)
        # dlse is None unless the loss used the LSE (grads are not materialized).
        dlse = None if dlse is None else dlse.contiguous()
        key = _call_key((dout, q, k, v, out, lse), ())
        key = None if key is None else (key, ctx.problem)
        if _CHECKED_BACKWARDS.get(key) is None:
            validate_backward_inputs(dout, q, k, v, out, lse, ctx.problem)
            _CHECKED_BACKWARDS.put(key, True)
        with torch.cuda.device(q.device):
            dq, dk, dv = _pipeline_module(ctx.pipeline).backward(
                dout, dlse, q, k, v, out, lse, ctx.problem, cu_seqlens_q, cu_seqlens_k,
                ctx.deterministic, **_seqused_kwargs(seqused_q, seqused_k))
        return _not_differentiable(dq, dk, dv) + (None,) * 8


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


def _seqused_kwargs(seqused_q, seqused_k) -> dict:
    """The seqused keywords, only when given: a pipeline without seqused support (which
    `check_capabilities` kept from getting them) has no such parameters."""
    if seqused_q is None and seqused_k is None:
        return {}
    return {"seqused_q": seqused_q, "seqused_k": seqused_k}


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (autograd may hand over expanded or offset gradients)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    arch: Optional[str] = None,
    pack_gqa: Optional[bool] = None,
):
    """Exact attention on [batch, seqlen, nheads, hdim] tensors; returns ``(out, lse)``.

    ``lse`` is [batch, nheads, seqlen_q] fp32 (natural log), ``None`` unless `return_lse` or a
    backward pass needs it. Masks are bottom-right aligned; ``window_size=(left, right)`` with
    None (or a negative int) for an unbounded side; GQA/MQA when k/v have fewer heads.

    ``pack_gqa`` (GQA/MQA forward): tile the query heads that share a K/V head together, so
    short query sequences (decode) fill a tile and K/V are read once per group. None lets the
    pipeline decide (`flash_cute.launch.packed_heads`); True requires it (NotImplementedError
    where the pipeline cannot: the ampere pipeline, or a group that does not divide the
    hopper tile's 128 rows); False never packs. The result is the same either way.
    """
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
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    arch: Optional[str] = None,
    pack_gqa: Optional[bool] = None,
):
    """Attention over sequences of different lengths; returns ``(out, lse)``.

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
    values must lie in [0, span] and be at most max_seqlen; they are not checked (that needs a
    device sync). Causal and local masks align bottom-right to the *used* lengths. Query rows
    past seqused_q[b] get out = 0 and lse = -inf, as a row that sees no key (flash-attn leaves
    them unwritten, so any value there meets its contract), and dq = 0; keys past seqused_k[b]
    get dk = dv = 0. ``pack_gqa`` as in `flash_attn_func`.

    Not supported (NotImplementedError before any launch): packed q with padded k/v or the
    reverse (cu_seqlens for one side only).
    """
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


class _Plan(NamedTuple):
    """What validation and dispatch decide for a call: the problem and the pipelines."""
    problem: AttentionProblem
    pipeline: str
    bwd_pipeline: Optional[str]  # None when no gradient is needed


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


# Calls already validated and dispatched, by `_call_key`: a repeated call skips validation,
# pipeline selection and the support checks, which are a third of a short call's host time
# (bench/launch_overhead.py). Each key holds everything those read.
_PLANS = _BoundedCache(256)
_CHECKED_BACKWARDS = _BoundedCache(256)


class _Uncached(Exception):
    pass


def _signature(t):
    """What validation and dispatch read of a tensor argument (it never reads values of CUDA
    tensors): dtype, device, shape, strides, address modulo 16 bytes, requires_grad. A tensor
    subclass (e.g. FakeTensor under torch.compile) or a non-tensor gets no key."""
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        raise _Uncached
    return t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16, t.requires_grad


_PLAIN = (type(None), bool, int, float, str)


def _plain(value):
    """`value` with its type, for a key (True and 1 validate differently but compare equal);
    tuples element by element. Anything else (a tensor, a list) gets no key."""
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if type(value) not in _PLAIN:
        raise _Uncached
    return type(value), value


def _call_key(tensors: tuple, options) -> Optional[tuple]:
    """A key of a call's tensors and other arguments (`_signature`, `_plain`), or None (then
    the call is validated every time)."""
    try:
        return (tuple(_signature(t) for t in tensors), _plain(options), torch.is_grad_enabled())
    except _Uncached:
        return None
    except RuntimeError:
        # A tensor without storage (sparse, ...): validation says what is wrong with it.
        return None


def _make_plan(q, k, v, problem, arch, deterministic) -> _Plan:
    pipeline = select_pipeline(q.device, arch, problem)
    check_capabilities(pipeline, problem)
    _pipeline_module(pipeline).check_supported(problem, q.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    bwd_pipeline = None
    if needs_grad:
        bwd_pipeline = select_backward_pipeline(q.device, pipeline, problem)
        check_capabilities(bwd_pipeline, problem)
        bwd_module = _pipeline_module(bwd_pipeline)
        bwd_module.check_supported(problem, q.device, backward=True)
        if deterministic and not bwd_module.DETERMINISTIC_BACKWARD:
            raise NotImplementedError(f"deterministic=True: the {bwd_pipeline} pipeline's backward "
                                      "adds dQ with atomics and is not deterministic")
    return _Plan(problem, pipeline, bwd_pipeline)


def _run(q, k, v, lengths: tuple, validate, options: tuple, arch, deterministic, return_lse):
    """`lengths`: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), each a tensor or None;
    `validate()` returns the call's `AttentionProblem` or raises; `options`: the call's other
    arguments, for the plan's key."""
    key = _call_key((q, k, v) + lengths, options)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k, v, validate(), arch, deterministic)
        _PLANS.put(key, plan)
    # Kernels launch on the current device and stream: make that q's device.
    with torch.cuda.device(q.device):
        out, lse = _FlashAttnFunc.apply(q, k, v, *lengths, plan.problem, plan.pipeline,
                                        plan.bwd_pipeline, deterministic)
    return out, (lse if (return_lse or plan.bwd_pipeline is not None) else None)
