"""Input validation shared by every flash-cute entry point.

Every public entry point (forward, backward, varlen) calls into this module
before it builds a kernel argument or launches anything.  A bad input must
surface here as a Python exception that names the argument, says what was
expected and shows what was given -- never as a CUDA error, an illegal memory
access, or a silently wrong result.  One exception by design: the *contents* of
CUDA ``cu_seqlens``/``seqused`` tensors are only read with ``check_contents=True``, or per
call with ``flash_cute.check_inputs`` (`check_index_contents`; reading them costs a device
sync), so ``max_seqlen`` covering the longest sequence, and ``seqused[b]`` lying in
``[0, span of sequence b]``, are the caller's promise to keep. Broken, they never make a
kernel touch memory outside its tensors (`flash_cute.blocks.seqlen` clamps them), but the results
are meaningless.

Exception types:

* ``TypeError`` -- wrong Python type or wrong tensor dtype.
* ``ValueError`` -- wrong shape, layout, device, value or inconsistent arguments.
* ``NotImplementedError`` -- a well-formed request that flash-cute has no kernel
  for (e.g. an unsupported head dimension, or a packed q with a padded k).

Layout conventions follow ``flash_attn.cute`` (flash-attn 4):

* padded:  q ``[batch, seqlen_q, nheads, hdim]``, k ``[batch, seqlen_k, nheads_kv, hdim]``,
  v ``[batch, seqlen_k, nheads_kv, hdim_v]``, lse ``[batch, nheads, seqlen_q]``.
* varlen:  q ``[total_q, nheads, hdim]``, k ``[total_k, nheads_kv, hdim]``,
  v ``[total_k, nheads_kv, hdim_v]``, lse ``[nheads, total_q]``, with int32
  ``cu_seqlens_q`` / ``cu_seqlens_k`` of shape ``[batch + 1]``.
* either layout may add int32 ``seqused_q`` / ``seqused_k`` of shape ``[batch]``: the
  number of leading rows of each sequence's span that are used (the rest is padding).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

__all__ = [
    "AttentionProblem",
    "validate_attention_inputs",
    "validate_backward_inputs",
]

# TMA and 128-bit cp.async move 16 bytes at a time, so every row start the
# kernels address must sit on a 16-byte boundary.
_ALIGN_BYTES = 16
_DEFAULT_HDIM_MIN = 8
_DEFAULT_HDIM_MAX = 256
_HDIM_MULTIPLE = 8
_DEFAULT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionProblem:
    """Normalized description of one attention call, consumed by the dispatcher.

    ``seqlen_q`` / ``seqlen_k`` are ``None`` for varlen problems; use
    ``max_seqlen_q`` / ``max_seqlen_k`` (always set) to size grids.

    ``has_seqused_q`` / ``has_seqused_k``: a per-sequence used length was given
    (``seqused_q`` / ``seqused_k``).  The tensors are run-time kernel arguments;
    these flags are what changes the compiled kernel.

    The mask is normalized: ``causal=True`` always has ``window_right == 0``,
    window bounds are ``None`` when unbounded (never negative), and a
    non-causal window of ``(None, 0)`` is reported as plain causal.

    ``pack_gqa`` is the caller's request (None: the pipeline decides); see
    `flash_cute.runtime.launch.packed_heads` for what a pipeline makes of it.
    """

    batch: int
    seqlen_q: int | None
    seqlen_k: int | None
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_kv: int
    hdim: int
    hdim_v: int
    dtype: torch.dtype
    varlen: bool
    softmax_scale: float
    causal: bool
    window_left: int | None
    window_right: int | None
    softcap: float
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    pack_gqa: bool | None = None
    dropout_p: float = 0.0
    # Split-KV request (FA4's meaning): 1 none, 0 the heuristic, n > 1 n splits; the
    # pipeline decides what runs (`flash_cute.runtime.splits.plan_splits`).
    num_splits: int = 1
    seqlen_k_per_split: int | None = None
    # The call's traced score / mask mods and block mask (`flash_cute.variants.mod_graph.Variant`),
    # compared and hashed by their registry key (plans are cached by problem).
    mods: object = field(default=None, compare=False)
    mods_key: int = 0
    # A backward that also accumulates the gradients of the score mod's learnable captured
    # tensors (`mod_graph.learnable`).
    mod_grads: bool = False

    @property
    def qheads_per_kvhead(self) -> int:
        """Number of query heads sharing one key/value head (1 for MHA, >1 for GQA/MQA)."""
        return self.nheads // self.nheads_kv

    @property
    def is_local(self) -> bool:
        """True when a sliding-window mask is needed, i.e. anything beyond plain causal."""
        if self.causal:
            return self.window_left is not None
        return self.window_left is not None or self.window_right is not None

    @property
    def has_softcap(self) -> bool:
        """True when logits are soft-capped (``softcap > 0``)."""
        return self.softcap > 0.0


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def validate_attention_inputs(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    pack_gqa=None,
    dropout_p=0.0,
    num_splits=1,
    seqlen_k_per_split=None,
    supported_dtypes: Collection[torch.dtype] = _DEFAULT_DTYPES,
    supported_hdims: Collection[tuple[int, int]] | None = None,
    require_cuda: bool = True,
    check_contents: bool = False,
) -> AttentionProblem:
    """Validate forward inputs and return the normalized :class:`AttentionProblem`.

    Args:
        q, k, v: query/key/value tensors in the padded or varlen layout (see module doc).
        softmax_scale: positive finite scale; ``None`` means ``1 / sqrt(hdim)``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)``; each ``None`` or int, negative meaning unbounded.
            With ``causal=True`` the right bound must be unbounded or 0.
        softcap: finite ``>= 0``; 0 disables soft-capping.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative lengths; give both
            (varlen) or neither (padded).
        seqused_q, seqused_k: optional int32 ``[batch]`` number of tokens actually used
            per sequence, in either layout: sequence ``b`` uses the first ``seqused[b]``
            rows of its span (``cu_seqlens[b]..cu_seqlens[b + 1]``, or the padded
            length), the rest is never read.  Each value must be in ``[0, span]`` and at
            most ``max_seqlen``; like cu_seqlens, CUDA values are only checked with
            ``check_contents``.
        max_seqlen_q, max_seqlen_k: required for varlen; upper bounds of the per-sequence
            lengths the kernels use (the span lengths, or ``seqused`` where given); they
            size the kernel grids.  For padded inputs they may be omitted or must equal
            the padded length.
        pack_gqa: ``None`` (the pipeline decides), ``True`` or ``False``: tile the query
            heads that share a K/V head together (packed GQA). It changes the schedule,
            not the result.
        dropout_p: dropout probability of the attention weights, in ``[0, 1)``.
        num_splits: split-KV, FA4's meaning: 1 no split, 0 (or below) the heuristic, n > 1
            n splits (at most 256).
        seqlen_k_per_split: None, or each split's length in keys (a multiple of the
            kernel's tile_n, checked by the pipeline), for results that do not depend on
            the split count.
        supported_dtypes: dtypes the target kernel handles.
        supported_hdims: allowed ``(hdim, hdim_v)`` pairs; ``None`` allows any multiple
            of 8 in ``[8, 256]`` for each.
        require_cuda: when False, skip only the "CUDA tensor / same device" checks so the
            rest can be exercised with CPU tensors.
        check_contents: also check the *values* of CUDA ``cu_seqlens_*`` / ``seqused_*``.
            This forces a device sync, so it is off by default; CPU tensors are always
            checked because reading them is free.

    Raises:
        TypeError, ValueError, NotImplementedError: see module docstring.
    """
    _check_tensor_args(q=q, k=k, v=v)
    _check_optional_tensor_args(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k,
    )
    varlen = _is_varlen(cu_seqlens_q, cu_seqlens_k)
    if require_cuda:
        _check_devices(
            q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q, seqused_k=seqused_k,
        )
    dtype = _check_qkv_dtypes(q, k, v, supported_dtypes)
    dims = _check_qkv_shapes(q, k, v, varlen)
    _check_head_dims(dims["hdim"], dims["hdim_v"], supported_hdims)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_memory_layout(name, t)

    if varlen:
        batch, max_q, max_k = _check_varlen_metadata(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
    else:
        batch, max_q, max_k = _check_padded_metadata(dims, max_seqlen_q, max_seqlen_k)
    _check_seqused("seqused_q", seqused_q, batch)
    _check_seqused("seqused_k", seqused_k, batch)
    _check_seqlen_contents(
        q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_q, max_k, force=check_contents,
    )

    scale = _check_softmax_scale(softmax_scale, dims["hdim"])
    cap = _check_softcap(softcap)
    causal, left, right = _normalize_mask(causal, window_size)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
    dropout_p = _check_dropout_p(dropout_p)
    num_splits, seqlen_k_per_split = check_splits(num_splits, seqlen_k_per_split)
    return AttentionProblem(
        batch=batch,
        seqlen_q=None if varlen else dims["seqlen_q"],
        seqlen_k=None if varlen else dims["seqlen_k"],
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        nheads=dims["nheads"],
        nheads_kv=dims["nheads_kv"],
        hdim=dims["hdim"],
        hdim_v=dims["hdim_v"],
        dtype=dtype,
        varlen=varlen,
        softmax_scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=cap,
        has_seqused_q=seqused_q is not None,
        has_seqused_k=seqused_k is not None,
        pack_gqa=pack_gqa,
        dropout_p=dropout_p,
        num_splits=num_splits,
        seqlen_k_per_split=seqlen_k_per_split,
    )


# FA4's bound on num_splits.
MAX_NUM_SPLITS = 256


def check_splits(num_splits, seqlen_k_per_split) -> tuple:
    """(num_splits with every value below 1 as 0, the heuristic; seqlen_k_per_split)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__} "
                        f"({num_splits!r})")
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be at most {MAX_NUM_SPLITS}, got {num_splits}")
    if seqlen_k_per_split is not None and (
            isinstance(seqlen_k_per_split, bool) or not isinstance(seqlen_k_per_split, int)
            or seqlen_k_per_split <= 0):
        raise ValueError(f"seqlen_k_per_split must be None or a positive int, got "
                         f"{seqlen_k_per_split!r}")
    return max(num_splits, 0), seqlen_k_per_split


def _check_dropout_p(dropout_p) -> float:
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def validate_backward_inputs(
    dout,
    q,
    k,
    v,
    out,
    lse,
    problem: AttentionProblem,
    *,
    require_cuda: bool = True,
) -> None:
    """Validate backward inputs against the forward's :class:`AttentionProblem`.

    Checks that q/k/v still match ``problem``, that ``out`` and ``dout`` have
    q's layout with ``hdim_v`` as last dim and ``problem.dtype``, and that
    ``lse`` is float32 ``[batch, nheads, seqlen_q]`` (varlen: ``[nheads, total_q]``).
    Memory-layout rules are the same as for the forward inputs, except for
    ``lse`` which only needs a unit-stride last dim (see ``_check_lse_layout``).

    Raises:
        TypeError, ValueError: see module docstring.
    """
    if not isinstance(problem, AttentionProblem):
        raise TypeError(
            f"problem must be the AttentionProblem returned by validate_attention_inputs, "
            f"got {type(problem).__name__}"
        )
    _check_tensor_args(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    if require_cuda:
        _check_devices(q=q, k=k, v=v, out=out, dout=dout, lse=lse)
    expected = _check_bwd_qkv_against_problem(q, k, v, problem)
    _check_out_and_dout(out, dout, expected["out"], problem)
    _check_lse(lse, expected["lse"], problem)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        _check_memory_layout(name, t)
    _check_lse_layout(lse)


# ---------------------------------------------------------------------------
# Argument types and devices
# ---------------------------------------------------------------------------


def _check_tensor_args(**tensors) -> None:
    """Reject non-tensor arguments up front so later checks can use tensor methods, and
    lazily negated views (`torch._neg_view`, e.g. from some conjugate/negate paths): their
    storage holds the un-negated values, which is what a kernel would read."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_neg():
            raise ValueError(f"{name} is a lazily negated view whose memory holds the "
                             f"un-negated values; pass {name}.resolve_neg()")


def _check_optional_tensor_args(**tensors) -> None:
    _check_tensor_args(**{name: t for name, t in tensors.items() if t is not None})


def _check_devices(**tensors) -> None:
    """All given tensors must live on one CUDA device (the first one's)."""
    present = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in present:
        if t.device.type != "cuda":
            raise ValueError(
                f"{name} must be a CUDA tensor, got a tensor on device '{t.device}' "
                f"(shape {_shape(t)}); flash-cute kernels run on the GPU, move inputs "
                f"with .cuda() (with every input on the CPU, the float32 reference runs instead)"
            )
    ref_name, ref = present[0]
    for name, t in present[1:]:
        if t.device != ref.device:
            raise ValueError(
                f"all inputs must be on the same CUDA device: {ref_name} is on "
                f"'{ref.device}' but {name} is on '{t.device}'"
            )


# ---------------------------------------------------------------------------
# dtypes and shapes
# ---------------------------------------------------------------------------


def _check_qkv_dtypes(q, k, v, supported_dtypes) -> torch.dtype:
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q.dtype={q.dtype}, "
            f"k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    if q.dtype not in tuple(supported_dtypes):
        raise TypeError(
            f"q, k and v must have dtype in {_dtype_names(supported_dtypes)}, got {q.dtype}; "
            f"convert with .to(torch.bfloat16) or .half()"
        )
    return q.dtype


def _check_qkv_shapes(q, k, v, varlen: bool) -> dict:
    """Check ranks and cross-tensor consistency; return the problem dims."""
    ndim = 3 if varlen else 4
    layout = (
        "[total, nheads, hdim] (varlen, because cu_seqlens_* were given)"
        if varlen
        else "[batch, seqlen, nheads, hdim]"
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got {name}.shape={_shape(t)}")
    lead = 1 if varlen else 2  # dims before the head dim: (total,) or (batch, seqlen)
    shapes = f"q.shape={_shape(q)}, k.shape={_shape(k)}, v.shape={_shape(v)}"
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must have the same batch size (dim 0), got {shapes}")
    if k.shape[:lead] != v.shape[:lead]:
        what = "total_k (dim 0)" if varlen else "seqlen_k (dim 1)"
        raise ValueError(f"k and v must have the same {what}, got {shapes}")
    if k.shape[lead] != v.shape[lead]:
        raise ValueError(f"k and v must have the same number of heads (dim {lead}), got {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim (last dim), got q hdim={q.shape[-1]} and "
            f"k hdim={k.shape[-1]} ({shapes}); only v may have a different head dim"
        )
    nheads, nheads_kv = q.shape[lead], k.shape[lead]
    _check_head_counts(nheads, nheads_kv, shapes)
    return {
        "seqlen_q": None if varlen else q.shape[1],
        "seqlen_k": None if varlen else k.shape[1],
        "batch": None if varlen else q.shape[0],
        "nheads": nheads,
        "nheads_kv": nheads_kv,
        "hdim": q.shape[-1],
        "hdim_v": v.shape[-1],
    }


def _check_head_counts(nheads: int, nheads_kv: int, shapes: str) -> None:
    if nheads <= 0 or nheads_kv <= 0:
        raise ValueError(
            f"nheads and nheads_kv must be positive, got nheads={nheads}, "
            f"nheads_kv={nheads_kv} ({shapes})"
        )
    if nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}, from q) must be a multiple of nheads_kv ({nheads_kv}, "
            f"from k/v) so each key/value head serves a whole group of query heads; got {shapes}"
        )


def _check_head_dims(hdim: int, hdim_v: int, supported_hdims) -> None:
    if supported_hdims is not None:
        pairs = {tuple(p) for p in supported_hdims}
        if (hdim, hdim_v) not in pairs:
            raise NotImplementedError(
                f"head dims (hdim={hdim}, hdim_v={hdim_v}) are not supported by this kernel; "
                f"supported (hdim, hdim_v) pairs: {sorted(pairs)}"
            )
        return
    for name, d in (("hdim", hdim), ("hdim_v", hdim_v)):
        if not (_DEFAULT_HDIM_MIN <= d <= _DEFAULT_HDIM_MAX and d % _HDIM_MULTIPLE == 0):
            raise NotImplementedError(
                f"{name}={d} is not supported: head dims must be multiples of "
                f"{_HDIM_MULTIPLE} in [{_DEFAULT_HDIM_MIN}, {_DEFAULT_HDIM_MAX}] "
                f"(got hdim={hdim}, hdim_v={hdim_v}); pad the head dim to a supported size"
            )


# ---------------------------------------------------------------------------
# Memory layout
# ---------------------------------------------------------------------------


def _check_memory_layout(name: str, t: torch.Tensor) -> None:
    """Unit-stride last dim, 16-byte-multiple outer strides, 16-byte-aligned pointer.

    Strides of size-1 dims are ignored: the kernel never steps along them and
    torch itself treats them as irrelevant for contiguity (``.contiguous()``
    would not change them).  A stride of 0 (a broadcast dim from ``expand``)
    is accepted because these tensors are only read.
    """
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head) dim, i.e. {name}.stride(-1) == 1, "
            f"got {name}.shape={_shape(t)}, {name}.stride()={t.stride()} "
            f"(e.g. a transposed view); call {name}.contiguous()"
        )
    elems = max(1, _ALIGN_BYTES // t.element_size())
    for dim in range(t.ndim - 1):
        stride = t.stride(dim)
        if t.shape[dim] > 1 and stride % elems != 0:
            raise ValueError(
                f"{name}.stride({dim})={stride} must be a multiple of {elems} elements "
                f"({_ALIGN_BYTES} bytes for {t.dtype}) so rows can be loaded with 16-byte "
                f"TMA/cp.async copies; got {name}.shape={_shape(t)}, "
                f"{name}.stride()={t.stride()} (e.g. a slice of a wider buffer); "
                f"call {name}.contiguous()"
            )
    misalign = _address(t) % _ALIGN_BYTES
    if misalign:
        raise ValueError(
            f"{name}.data_ptr() must be {_ALIGN_BYTES}-byte aligned, but it is "
            f"{misalign} bytes past a {_ALIGN_BYTES}-byte boundary "
            f"({name}.shape={_shape(t)}, storage_offset={t.storage_offset()}); {name} is "
            f"probably a view at an odd offset into a larger buffer; pass "
            f"{name}.clone(memory_format=torch.contiguous_format)"
        )


def _check_lse_layout(lse: torch.Tensor) -> None:
    """lse rows are read with scalar loads, so only a unit-stride last dim is needed.

    Demanding 16-byte strides here would reject the forward's own contiguous
    lse whenever seqlen_q is not a multiple of 4.
    """
    if lse.shape[-1] > 1 and lse.stride(-1) != 1:
        raise ValueError(
            f"lse must be contiguous in its last dim, i.e. lse.stride(-1) == 1, got "
            f"lse.shape={_shape(lse)}, lse.stride()={lse.stride()}; call lse.contiguous()"
        )
    if _address(lse) % lse.element_size():
        raise ValueError(
            f"lse.data_ptr() must be {lse.element_size()}-byte aligned "
            f"(storage_offset={lse.storage_offset()}); pass lse.clone()"
        )


def _address(t: torch.Tensor) -> int:
    """Device address, or an offset-equivalent for tensors without real storage."""
    if t.device.type == "meta" or _is_fake(t):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def _is_fake(t: torch.Tensor) -> bool:
    # A plain tensor is never fake; the import (FakeTensor only matters under torch.compile
    # tracing) is left to the tensor subclasses.
    if type(t) is torch.Tensor:
        return False
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(t, FakeTensor)


# ---------------------------------------------------------------------------
# Sequence-length metadata (varlen and seqused)
# ---------------------------------------------------------------------------


def _is_varlen(cu_seqlens_q, cu_seqlens_k) -> bool:
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given = "cu_seqlens_q" if cu_seqlens_q is not None else "cu_seqlens_k"
        missing = "cu_seqlens_k" if cu_seqlens_q is not None else "cu_seqlens_q"
        raise NotImplementedError(
            f"{given} was given without {missing}: mixing a packed (varlen) layout with a "
            f"padded one is not supported; pass both cu_seqlens_q and cu_seqlens_k, or "
            f"neither with padded q, k, v (per-batch lengths of a padded k, e.g. a KV "
            f"cache, go in seqused_k)"
        )
    return cu_seqlens_q is not None


def _check_int32_vector(name: str, t: torch.Tensor, length: int | None, meaning: str) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got dtype {t.dtype}; use {name}.int()")
    if t.ndim != 1 or (length is not None and t.shape[0] != length):
        want = f"[{length}] ({meaning})" if length is not None else f"1-D [{meaning}]"
        raise ValueError(f"{name} must have shape {want}, got {name}.shape={_shape(t)}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(
            f"{name} must be contiguous, got {name}.stride()={t.stride()}; "
            f"call {name}.contiguous()"
        )


def _check_varlen_metadata(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Return (batch, max_seqlen_q, max_seqlen_k) for the packed layout."""
    _check_int32_vector("cu_seqlens_q", cu_seqlens_q, None, "batch + 1")
    _check_int32_vector("cu_seqlens_k", cu_seqlens_k, None, "batch + 1")
    if cu_seqlens_q.shape[0] == 0:
        raise ValueError(
            "cu_seqlens_q must have at least one entry (shape [batch + 1]), got shape (0,)"
        )
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have shape [batch + 1], got "
            f"cu_seqlens_q.shape={_shape(cu_seqlens_q)} (batch "
            f"{cu_seqlens_q.shape[0] - 1}) and cu_seqlens_k.shape={_shape(cu_seqlens_k)} "
            f"(batch {cu_seqlens_k.shape[0] - 1})"
        )
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, required=True)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, required=True)
    return cu_seqlens_q.shape[0] - 1, max_q, max_k


def _check_padded_metadata(dims: dict, max_seqlen_q, max_seqlen_k):
    """Return (batch, max_seqlen_q, max_seqlen_k) for the padded layout."""
    for name, value, seqlen in (
        ("max_seqlen_q", max_seqlen_q, dims["seqlen_q"]),
        ("max_seqlen_k", max_seqlen_k, dims["seqlen_k"]),
    ):
        given = _check_max_seqlen(name, value, required=False)
        if given is not None and given != seqlen:
            raise ValueError(
                f"{name}={given} does not match the padded sequence length {seqlen} of the "
                f"inputs; {name} is only needed with cu_seqlens_* (varlen), omit it here"
            )
    return dims["batch"], dims["seqlen_q"], dims["seqlen_k"]


def _check_max_seqlen(name: str, value, *, required: bool) -> int | None:
    if value is None:
        if required:
            raise ValueError(
                f"{name} is required for varlen inputs (cu_seqlens_* given): it sizes the "
                f"kernel grid and must be >= the longest sequence; got None"
            )
        return None
    if isinstance(value, torch.SymInt):
        # A traced length (torch.compile, dynamic shapes): kept symbolic, so the trace is not
        # specialized to one length.
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_seqused(name: str, t, batch: int) -> None:
    if t is not None:
        _check_int32_vector(name, t, batch, "batch")


def _should_read(t, force: bool) -> bool:
    # Reading a CUDA tensor from the host syncs the device; only do it on request. A fake
    # tensor (a trace) has no values to read.
    if t is None or _is_fake(t):
        return False
    return t.device.type == "cpu" or (force and t.device.type == "cuda")


def _check_seqlen_contents(
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
    _check_seqlen_contents(q, k, *host, max_q, max_k, force=False)


# ---------------------------------------------------------------------------
# Scalars and mask normalization
# ---------------------------------------------------------------------------


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def _check_softmax_scale(softmax_scale, hdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(hdim)
    scale = _real("softmax_scale", softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(hdim) = "
            f"{1.0 / math.sqrt(hdim):.6g}), got {softmax_scale!r}"
        )
    return scale


def _check_softcap(softcap) -> float:
    cap = _real("softcap", softcap)
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    return cap


def _normalize_window_bound(name: str, bound) -> int | None:
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, numbers.Integral):
        raise TypeError(
            f"{name} must be None or an int (negative = unbounded), got "
            f"{type(bound).__name__} ({bound!r})"
        )
    return None if bound < 0 else int(bound)


def _normalize_mask(causal, window_size) -> tuple[bool, int | None, int | None]:
    """Return (causal, window_left, window_right) in canonical form."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} ({causal!r})")
    if isinstance(window_size, (str, bytes)) or not _is_pair(window_size):
        raise TypeError(
            f"window_size must be a (left, right) pair of None/int, got {window_size!r}"
        )
    left = _normalize_window_bound("window_size[0] (left)", window_size[0])
    right = _normalize_window_bound("window_size[1] (right)", window_size[1])
    if causal:
        if right is not None and right > 0:
            raise ValueError(
                f"causal=True masks every key right of the diagonal, so the right window "
                f"bound must be None, negative or 0, got window_size={tuple(window_size)!r}; "
                f"for a window that looks {right} keys ahead use causal=False with "
                f"window_size=({window_size[0]!r}, {right})"
            )
        return True, left, 0
    if left is None and right == 0:
        # (None, 0) is exactly the causal mask; report it as such so the
        # dispatcher picks the cheaper causal path instead of the local one.
        return True, None, 0
    return False, left, right


def _is_pair(value) -> bool:
    try:
        return len(value) == 2
    except TypeError:
        return False


# ---------------------------------------------------------------------------
# Backward-specific checks
# ---------------------------------------------------------------------------


def _expected_shapes(problem: AttentionProblem, total_q: int, total_k: int) -> dict:
    p = problem
    if p.varlen:
        return {
            "q": (total_q, p.nheads, p.hdim),
            "k": (total_k, p.nheads_kv, p.hdim),
            "v": (total_k, p.nheads_kv, p.hdim_v),
            "out": (total_q, p.nheads, p.hdim_v),
            "lse": (p.nheads, total_q),
        }
    return {
        "q": (p.batch, p.seqlen_q, p.nheads, p.hdim),
        "k": (p.batch, p.seqlen_k, p.nheads_kv, p.hdim),
        "v": (p.batch, p.seqlen_k, p.nheads_kv, p.hdim_v),
        "out": (p.batch, p.seqlen_q, p.nheads, p.hdim_v),
        "lse": (p.batch, p.nheads, p.seqlen_q),
    }


def _check_shape(name: str, t: torch.Tensor, expected: tuple, problem: AttentionProblem) -> None:
    if tuple(t.shape) != tuple(expected):
        layout = "varlen" if problem.varlen else "padded"
        raise ValueError(
            f"{name}.shape={_shape(t)} does not match the {layout} forward problem: "
            f"expected {tuple(expected)}"
        )


def _check_bwd_qkv_against_problem(q, k, v, problem: AttentionProblem) -> dict:
    """Check q/k/v against the problem; return the expected shape of every tensor."""
    ndim = 3 if problem.varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != ndim:
            layout = "varlen" if problem.varlen else "padded"
            raise ValueError(
                f"{name} must be {ndim}-D for this {layout} problem, got {name}.shape={_shape(t)}"
            )
        if t.dtype != problem.dtype:
            raise TypeError(
                f"{name}.dtype={t.dtype} does not match the forward problem dtype {problem.dtype}"
            )
    # For varlen the token totals are not part of the problem; take them from
    # q/k, whose ranks were just checked.
    expected = _expected_shapes(problem, q.shape[0], k.shape[0])
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_shape(name, t, expected[name], problem)
    return expected


def _check_out_and_dout(out, dout, expected: tuple, problem: AttentionProblem) -> None:
    _check_shape("out", out, expected, problem)
    if out.dtype != problem.dtype:
        raise TypeError(f"out.dtype={out.dtype} must match q/k/v dtype {problem.dtype}")
    if tuple(dout.shape) != tuple(out.shape):
        raise ValueError(
            f"dout must have the same shape as out, got dout.shape={_shape(dout)} and "
            f"out.shape={_shape(out)}"
        )
    if dout.dtype != out.dtype:
        raise TypeError(
            f"dout must have the same dtype as out, got dout.dtype={dout.dtype} and "
            f"out.dtype={out.dtype}"
        )


def _check_lse(lse, expected: tuple, problem: AttentionProblem) -> None:
    if lse.dtype != torch.float32:
        raise TypeError(
            f"lse must be float32 (the log-sum-exp saved by the forward), got {lse.dtype}"
        )
    layout = "[nheads, total_q]" if problem.varlen else "[batch, nheads, seqlen_q]"
    if tuple(lse.shape) != tuple(expected):
        raise ValueError(
            f"lse must have shape {layout} = {tuple(expected)}, got lse.shape={_shape(lse)}"
        )


# ---------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _dtype_names(dtypes) -> list[str]:
    return [str(d) for d in dtypes]
