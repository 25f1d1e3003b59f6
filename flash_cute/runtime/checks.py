"""The input checks every entry point's validation runs (`flash_cute.runtime.problem`):
types, dtypes, devices, shapes, head counts and dims, memory layouts, scalar arguments and the
mask's window. Each raises a TypeError, ValueError or NotImplementedError that names the
argument, says what was expected and shows what was given."""

from __future__ import annotations

import math
import numbers

import torch

# TMA and 128-bit cp.async move 16 bytes at a time, so every row start the
# kernels address must sit on a 16-byte boundary.
ALIGN_BYTES = 16
DEFAULT_HDIM_MIN = 8
DEFAULT_HDIM_MAX = 256
HDIM_MULTIPLE = 8


def expected_shapes(problem, total_q: int, total_k: int) -> dict:
    """The shapes an `AttentionProblem`'s tensors must have (its layout, padded or varlen)."""
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


def check_dropout_p(dropout_p) -> float:
    p = real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def check_tensor_args(**tensors) -> None:
    """Reject non-tensor arguments up front so later checks can use tensor methods, and
    lazily negated views (`torch._neg_view`, e.g. from some conjugate/negate paths): their
    storage holds the un-negated values, which is what a kernel would read."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_neg():
            raise ValueError(f"{name} is a lazily negated view whose memory holds the "
                             f"un-negated values; pass {name}.resolve_neg()")


def check_optional_tensor_args(**tensors) -> None:
    check_tensor_args(**{name: t for name, t in tensors.items() if t is not None})


def check_devices(**tensors) -> None:
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


def check_qkv_dtypes(q, k, v, supported_dtypes) -> torch.dtype:
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


def check_qkv_shapes(q, k, v, varlen: bool) -> dict:
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


def check_head_dims(hdim: int, hdim_v: int, supported_hdims) -> None:
    if supported_hdims is not None:
        pairs = {tuple(p) for p in supported_hdims}
        # Compared one by one: a traced head dim (a SymInt) has no hash.
        if not any(hdim == a and hdim_v == b for a, b in pairs):
            raise NotImplementedError(
                f"head dims (hdim={hdim}, hdim_v={hdim_v}) are not supported by this kernel; "
                f"supported (hdim, hdim_v) pairs: {sorted(pairs)}"
            )
        return
    for name, d in (("hdim", hdim), ("hdim_v", hdim_v)):
        if not (DEFAULT_HDIM_MIN <= d <= DEFAULT_HDIM_MAX and d % HDIM_MULTIPLE == 0):
            raise NotImplementedError(
                f"{name}={d} is not supported: head dims must be multiples of "
                f"{HDIM_MULTIPLE} in [{DEFAULT_HDIM_MIN}, {DEFAULT_HDIM_MAX}] "
                f"(got hdim={hdim}, hdim_v={hdim_v}); pad the head dim to a supported size"
            )


def check_memory_layout(name: str, t: torch.Tensor) -> None:
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
    elems = max(1, ALIGN_BYTES // t.element_size())
    for dim in range(t.ndim - 1):
        stride = t.stride(dim)
        if t.shape[dim] > 1 and stride % elems != 0:
            raise ValueError(
                f"{name}.stride({dim})={stride} must be a multiple of {elems} elements "
                f"({ALIGN_BYTES} bytes for {t.dtype}) so rows can be loaded with 16-byte "
                f"TMA/cp.async copies; got {name}.shape={_shape(t)}, "
                f"{name}.stride()={t.stride()} (e.g. a slice of a wider buffer); "
                f"call {name}.contiguous()"
            )
    misalign = _address(t) % ALIGN_BYTES
    if misalign:
        raise ValueError(
            f"{name}.data_ptr() must be {ALIGN_BYTES}-byte aligned, but it is "
            f"{misalign} bytes past a {ALIGN_BYTES}-byte boundary "
            f"({name}.shape={_shape(t)}, storage_offset={t.storage_offset()}); {name} is "
            f"probably a view at an odd offset into a larger buffer; pass "
            f"{name}.clone(memory_format=torch.contiguous_format)"
        )


def check_lse_layout(lse: torch.Tensor) -> None:
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
    if t.device.type == "meta" or is_fake(t):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def is_fake(t: torch.Tensor) -> bool:
    # A plain tensor is never fake; the import (FakeTensor only matters under torch.compile
    # tracing) is left to the tensor subclasses.
    if type(t) is torch.Tensor:
        return False
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(t, FakeTensor)


def is_varlen(cu_seqlens_q, cu_seqlens_k) -> bool:
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


def check_varlen_metadata(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
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


def check_padded_metadata(dims: dict, max_seqlen_q, max_seqlen_k):
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


def check_seqused(name: str, t, batch: int) -> None:
    if t is not None:
        _check_int32_vector(name, t, batch, "batch")


def real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def check_softmax_scale(softmax_scale, hdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(hdim)
    scale = real("softmax_scale", softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(hdim) = "
            f"{1.0 / math.sqrt(hdim):.6g}), got {softmax_scale!r}"
        )
    return scale


def check_softcap(softcap) -> float:
    cap = real("softcap", softcap)
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


def normalize_mask(causal, window_size) -> tuple[bool, int | None, int | None]:
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


def _check_shape(name: str, t: torch.Tensor, expected: tuple, problem) -> None:
    if tuple(t.shape) != tuple(expected):
        layout = "varlen" if problem.varlen else "padded"
        raise ValueError(
            f"{name}.shape={_shape(t)} does not match the {layout} forward problem: "
            f"expected {tuple(expected)}"
        )


def check_bwd_qkv_against_problem(q, k, v, problem) -> dict:
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
    expected = expected_shapes(problem, q.shape[0], k.shape[0])
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_shape(name, t, expected[name], problem)
    return expected


def check_out_and_dout(out, dout, expected: tuple, problem) -> None:
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


def check_lse(lse, expected: tuple, problem) -> None:
    if lse.dtype != torch.float32:
        raise TypeError(
            f"lse must be float32 (the log-sum-exp saved by the forward), got {lse.dtype}"
        )
    layout = "[nheads, total_q]" if problem.varlen else "[batch, nheads, seqlen_q]"
    if tuple(lse.shape) != tuple(expected):
        raise ValueError(
            f"lse must have shape {layout} = {tuple(expected)}, got lse.shape={_shape(lse)}"
        )


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _dtype_names(dtypes) -> list[str]:
    return [str(d) for d in dtypes]
