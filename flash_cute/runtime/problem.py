"""Input validation shared by every flash-cute entry point.

Every public entry point (forward, backward, varlen) calls into this module (and its checks,
`flash_cute.runtime.checks`, and content reads, `flash_cute.runtime.contents`)
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

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from flash_cute.runtime.checks import (
    check_bwd_qkv_against_problem,
    check_devices,
    check_dropout_p,
    check_head_dims,
    check_lse,
    check_lse_layout,
    check_memory_layout,
    check_optional_tensor_args,
    check_out_and_dout,
    check_padded_metadata,
    check_qkv_dtypes,
    check_qkv_shapes,
    check_seqused,
    check_softcap,
    check_softmax_scale,
    check_tensor_args,
    check_varlen_metadata,
    is_varlen,
    normalize_mask,
)
from flash_cute.runtime.contents import check_seqlen_contents

__all__ = [
    "AttentionProblem",
    "validate_attention_inputs",
    "validate_backward_inputs",
]


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
    # The seed's coordinate frame: "", "shift" or "frame" (`contract.constants`).
    dropout_frame: str = ""
    # Split-KV request (FA4's meaning): 1 none, 0 the heuristic, n > 1 n splits; the
    # pipeline decides what runs (`flash_cute.runtime.splits.plan_splits`).
    num_splits: int = 1
    seqlen_k_per_split: int | None = None
    # The call's traced score / mask mods and block mask (`flash_cute.variants.registry.CallMods`),
    # compared and hashed by their registry key (plans are cached by problem).
    mods: object = field(default=None, compare=False)
    mods_key: int = 0
    # A backward that also accumulates the gradients of the score mod's learnable captured
    # tensors (`derivative.learnable`).
    mod_grads: bool = False
    # The forward returns O in float32 with its LSE, unmerged and unrounded (the operator's
    # `partial_out`: a ring step's partial, merged by its caller): a split-KV launch of one
    # split (`splits.plan_splits`), whose partial is that O.
    partial_out: bool = False
    # The backward returns dQ, dK, dV in float32 (the operator's `grads_fp32`: a ring step's
    # gradients, summed over the steps by its caller): dK/dV from the kernel's float32 path,
    # dQ from its float32 accumulator scaled, not rounded.
    grads_fp32: bool = False

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
    check_tensor_args(q=q, k=k, v=v)
    check_optional_tensor_args(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k,
    )
    varlen = is_varlen(cu_seqlens_q, cu_seqlens_k)
    if require_cuda:
        check_devices(
            q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q, seqused_k=seqused_k,
        )
    dtype = check_qkv_dtypes(q, k, v, supported_dtypes)
    dims = check_qkv_shapes(q, k, v, varlen)
    check_head_dims(dims["hdim"], dims["hdim_v"], supported_hdims)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_memory_layout(name, t)

    if varlen:
        batch, max_q, max_k = check_varlen_metadata(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
    else:
        batch, max_q, max_k = check_padded_metadata(dims, max_seqlen_q, max_seqlen_k)
    check_seqused("seqused_q", seqused_q, batch)
    check_seqused("seqused_k", seqused_k, batch)
    check_seqlen_contents(
        q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_q, max_k, force=check_contents,
    )

    scale = check_softmax_scale(softmax_scale, dims["hdim"])
    cap = check_softcap(softcap)
    causal, left, right = normalize_mask(causal, window_size)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
    dropout_p = check_dropout_p(dropout_p)
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
    ``lse`` which only needs a unit-stride last dim (see ``check_lse_layout``).

    Raises:
        TypeError, ValueError: see module docstring.
    """
    if not isinstance(problem, AttentionProblem):
        raise TypeError(
            f"problem must be the AttentionProblem returned by validate_attention_inputs, "
            f"got {type(problem).__name__}"
        )
    check_tensor_args(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    if require_cuda:
        check_devices(q=q, k=k, v=v, out=out, dout=dout, lse=lse)
    expected = check_bwd_qkv_against_problem(q, k, v, problem)
    check_out_and_dout(out, dout, expected["out"], problem)
    check_lse(lse, expected["lse"], problem)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        check_memory_layout(name, t)
    check_lse_layout(lse)


