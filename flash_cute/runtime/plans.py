"""The CUDA implementations of the `flash_cute::fwd` / `flash_cute::bwd` operators
(`flash_cute.api.ops`), and the plan caches that make a repeated call cheap.

A call is validated in one pass (`flash_cute.runtime.call`), dispatched in one decision
(`flash_cute.runtime.dispatch.choose_pipelines`: the newest pipeline that runs on the device and
has what the problem needs, or the one ``arch=`` forces, and the backward's) and planned (the
pipeline's `plan_forward` / `plan_backward`: everything the call's dtypes, shapes, strides
and options fix) once; a plan cache keyed by those (`_call_key`) then skips straight to
allocating and launching (host time decides short calls: `bench latency`).
"""

import contextlib
import os
import threading
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from flash_cute.contract.descriptor import APPEND, Pipeline
from flash_cute.runtime import call, paging
from flash_cute.runtime.cache_contents import check_page_entries, host_copies
from flash_cute.runtime.contents import check_index_contents
from flash_cute.runtime.dispatch import choose_pipelines
from flash_cute.runtime.problem import AttentionProblem
from flash_cute.variants import derivative, registry


class _Plan(NamedTuple):
    """What validation and dispatch decide for a forward call, and its launch."""
    problem: AttentionProblem
    pipeline: Pipeline
    bwd_pipeline: Optional[Pipeline]  # None when no gradient is needed
    deterministic: bool
    launch: object  # the pipeline's `plan_forward` for the call (a `launch_fwd.ForwardLaunch`)


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


# Forward plans and backward launches by `_call_key`. Each key holds everything validation,
# dispatch and planning read.
_PLANS = _BoundedCache(256)
_BWD_PLANS = _BoundedCache(256)

# The opt-in content check (`check_inputs`), from FLASH_CUTE_CHECK_INPUTS=1 at import.
_CHECK_INPUTS = [os.environ.get("FLASH_CUTE_CHECK_INPUTS", "0") not in ("", "0")]


def check_inputs(on: bool = True) -> bool:
    """Check the *contents* of every call's index tensors, raising ValueError that names the
    tensor, the entry and its valid range before anything is written: cu_seqlens (from 0,
    non-decreasing, inside the tensor), seqused (within each sequence's span), max_seqlen
    (covering the longest sequence), page_table / block_table (the entries a sequence uses
    are pages of the cache), and `flash_attn_with_kvcache`'s cache_seqlens, appends,
    cache_batch_idx, cache_leftpad and rotary positions (`flash_cute.runtime.cache_contents`).
    Off by default for CUDA tensors (also `FLASH_CUTE_CHECK_INPUTS=1`): it reads them to the
    host, one device sync per call, which breaks CUDA graph capture and stalls the launch
    queue; CPU tensors are checked always. With it off, bad contents never make a kernel
    touch memory outside its tensors (`flash_cute.blocks.seqlen`) and an append that does not
    fit is dropped and counted (`flash_cute.check_status`), but results are meaningless
    (docs/guide/reliability.md).

    Args:
        on: check from now on (True) or not (False).

    Returns:
        The previous setting.

    Raises:
        Nothing of its own; the calls it turns checking on for raise ValueError."""
    previous, _CHECK_INPUTS[0] = _CHECK_INPUTS[0], bool(on)
    return previous


def content_check_on() -> bool:
    """Whether the content check (`check_inputs`) is on."""
    return _CHECK_INPUTS[0]


def clear_plans() -> None:
    """Forget every planned call (the next call of each is validated and planned again), e.g.
    after changing `FLASH_CUTE_EX2_EMULATION`.

    Raises:
        Nothing."""
    _PLANS.clear()
    _BWD_PLANS.clear()


_PLAIN = frozenset({type(None), bool, int, float, str, tuple})


def _call_key(tensors: tuple, options: tuple) -> Optional[tuple]:
    """A key of a call's tensors and other arguments, or None (then the call is validated
    every time).

    Of each tensor, what validation and dispatch read (they never read values of CUDA
    tensors): dtype, device, shape, strides, address modulo 16 bytes, requires_grad; a tensor
    subclass (e.g. FakeTensor under torch.compile) or a non-tensor gets no key. `options`:
    plain values, and tuples of them, kept with their types (True and 1 validate differently
    but compare equal); anything else (a tensor, a list) gets no key."""
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


def _make_plan(q, k, v, lengths: tuple, options: tuple, rng_seed, splits,
               page_table=None, append=None, partial: bool = False) -> _Plan:
    """A forward call's plan, top-down: its one validation pass, its one dispatch decision
    (the backward's pipeline too, where a gradient is needed: refused now rather than after
    the forward ran), then the pipeline's launch."""
    deterministic, arch, needs_grad = options[8:11]
    problem = call.forward_problem(q, k, v, lengths, options, rng_seed, splits, page_table,
                                   append, partial)
    pipeline, bwd_pipeline = choose_pipelines(q.device, arch, problem, backward=needs_grad,
                                              deterministic=deterministic)
    paged = {} if page_table is None else {"page_table": page_table}
    if append is not None and APPEND in pipeline.capabilities:
        paged["append"] = append
    with torch.cuda.device(q.device):
        launch = pipeline.plan_forward(q, k, v, problem, *lengths, **paged)
    if append is not None and APPEND not in pipeline.capabilities:
        from flash_cute.runtime.launch_fwd import AppendFirst

        launch = AppendFirst(launch)
    return _Plan(problem, pipeline, bwd_pipeline, bool(deterministic), launch)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *options):
    """`flash_cute::fwd` on CUDA tensors: ``(out, lse)``. `options` as the operator's schema
    (`flash_cute.api.ops`) orders them, after the tensors (the last, rng_seed, a tensor or
    None)."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    splits = fwd_splits(options)
    page_table = options[16] if len(options) > 16 else None
    partial = len(options) > 17 and bool(options[17])
    # (k_new, v_new): written into the cache by the call (`interface.attend_and_append`,
    # eager calls only: the operator's schema has no such argument).
    append = tuple(options[18:20]) if len(options) > 18 else None
    options, rng_seed = split_seed(options, 13)
    key = _call_key((q, k, v, rng_seed, page_table) + lengths + (append or ()),
                    options + splits + (partial,))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k, v, lengths, options, rng_seed, splits, page_table, append,
                          partial)
        _PLANS.put(key, plan)
    if _CHECK_INPUTS[0] and (lengths != (None, None, None, None) or page_table is not None):
        # Contents change from call to call under the same key: checked every call.
        _check_contents(q, k, v, lengths, plan.problem, page_table)
    paged = {} if page_table is None else {"page_table": page_table}
    if append is not None:
        paged["append"] = append
    # Kernels launch on the current device and stream: make that q's device.
    with on_device(q):
        return plan.launch(q, k, v, *lengths, rng_seed=rng_seed, **paged)


def _check_contents(q, k, v, lengths, problem, page_table) -> None:
    """`check_index_contents` of a call (a paged one against the K its table stands for),
    and the page table's entries that the sequences use inside the cache; the index tensors
    read to the host in one transfer."""
    table, *lengths = host_copies(page_table, *lengths)
    cu_q, cu_k, used_q, used_k = lengths
    if page_table is not None:
        k, _, cu_k = paging.logical(k, v, page_table, cu_q is not None)
    check_index_contents(q, k, cu_q, cu_k, used_q, used_k, problem.max_seqlen_q,
                         problem.max_seqlen_k)
    if page_table is not None:
        check_page_entries("page_table", table, v.shape[0], v.shape[1], used_k)


def fwd_splits(options: tuple) -> tuple:
    """(num_splits, seqlen_k_per_split) of a forward call's options (after rng_seed, at
    14 and 15; left out where they are the defaults)."""
    tail = options[14:16]
    return tuple(tail) + (1, None)[len(tail):]


def split_seed(options: tuple, count: int):
    """(options without rng_seed, rng_seed): a call may stop before the dropout options (the
    dispatcher leaves out trailing arguments equal to their defaults, and a direct call may
    omit dropout_p 0 and no seed); the missing ones are filled in."""
    if len(options) > count:
        return options[:count], options[count]
    return options + (0.0,) * (count - len(options)), None


# `flash_cute::bwd`'s last option: the learnable captured tensors' gradients asked for.
_MOD_GRADS = 13


def mod_grads_asked(options: tuple) -> bool:
    """Whether a `flash_cute::bwd` call's options ask for the gradients of learnable captured
    tensors (`mod_grads`, trailing and optional)."""
    return len(options) > _MOD_GRADS and bool(options[_MOD_GRADS])


def backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
             *options):
    """`flash_cute::bwd` on CUDA tensors: ``(dq, dk, dv, dmods)``."""
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    wide = len(options) > _MOD_GRADS + 1 and bool(options[_MOD_GRADS + 1])
    mod_grads = mod_grads_asked(options)
    options, rng_seed = split_seed(options[:_MOD_GRADS], 12)
    options += (mod_grads,)
    dout = kernel_ready(dout)
    dlse = None if dlse is None else dlse.contiguous()
    key = _call_key((dout, dlse, q, k, v, out, lse, rng_seed) + lengths, options + (wide,))
    launch = _BWD_PLANS.get(key)
    if launch is not None and mod_grads and not _same_learned(launch, options[10]):
        launch = None   # which captured tensors require grad changed since it was planned
    if launch is None:
        deterministic, arch = options[8:10]
        problem = call.backward_problem(dout, q, k, v, out, lse, lengths, options, rng_seed,
                                        mod_grads, wide)
        _, bwd_pipeline = choose_pipelines(q.device, arch, problem, backward=True,
                                           deterministic=deterministic, forward_checks=False)
        with torch.cuda.device(q.device):
            launch = bwd_pipeline.plan_backward(dout, dlse, q, k, v, out, lse, problem,
                                                *lengths, bool(deterministic))
        _BWD_PLANS.put(key, launch)
    dmods = []
    with on_device(q):
        dq, dk, dv = launch(dout, dlse, q, k, v, out, lse, *lengths, rng_seed=rng_seed,
                            mod_grads=dmods if mod_grads else None)
    return dq, dk, dv, dmods


def _same_learned(launch, key: int) -> bool:
    learned = derivative.learnable(registry.lookup(key))
    return len(learned) == len(launch.aux.learned) and all(
        a is b for a, b in zip(learned, launch.aux.learned))


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (autograd may hand over expanded or offset gradients)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


_SAME_DEVICE = contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """`torch.cuda.device(t.device)`, or nothing to do when it is current already (the
    common case, for a few microseconds less per call)."""
    index = t.get_device()
    if index >= 0 and index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(t.device)
