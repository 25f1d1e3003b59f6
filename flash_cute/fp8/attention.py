"""The FP8 forward's entry point: e4m3 Q, K and V with FA3's per-(batch, K/V head) descales,
a bf16 or fp16 O. On a Hopper GPU it runs the FP8 kernel (`hopper.fwd_fp8`); on the CPU the
torch emulation of that kernel's computation (`emulation.emulate`). Forward only."""

from __future__ import annotations

import math

import torch

from flash_cute.fp8.emulation import emulate
from flash_cute.fp8.quant import BLOCK
from flash_cute.runtime.problem import validate_attention_inputs

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16)
# (hdim, hdim_v) pairs the FP8 kernel takes (`arch/hopper/config.FP8_SUPPORTED_HDIMS`).
FP8_HDIMS = ((64, 64), (128, 128), (192, 128), (256, 256))


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def check_fp8_inputs(q, k, v, descales, out_dtype) -> None:
    """Clear errors, before any launch, for what the FP8 forward cannot take."""
    kinds = {name: is_fp8(t) for name, t in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) > 1:
        raise TypeError(f"FP8 attention takes float8_e4m3fn (or float8_e5m2) q, k and v "
                        f"together; got q {q.dtype}, k {k.dtype}, v {v.dtype} (quantize all "
                        f"three with flash_cute.fp8.quantize_fp8, or pass 16-bit ones)")
    if any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("the FP8 forward has no backward: for training, call "
                                  "flash_attn_func with bf16 q, k and v")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    given = [(name, d) for name, d in zip(("q_descale", "k_descale", "v_descale"), descales)
             if d is not None]
    for name, d in given:
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or d.dim() not in (2, 3):
            raise TypeError(f"{name} must be a float32 tensor, [batch, nheads_kv] (FA3's "
                            f"descales) or [batch, blocks, heads] (block scales), got "
                            f"{_describe(d)}")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device}, q on {q.device}")
    if len({d.dim() for _, d in given}) > 1:
        raise ValueError("pass FA3's descales ([batch, nheads_kv]) or block scales ([batch, "
                         "blocks, heads]) for q, k and v alike, not a mix")


def block_scaled(descales) -> bool:
    """Whether the scales are per 128-token block (rank 3), not per (batch, K/V head)."""
    return any(d is not None and d.dim() == 3 for d in descales)


def _scales(descales, problem, device) -> tuple:
    """The three scales checked against the problem, float32, 1.0 where None: FA3's
    descales [batch, nheads_kv], or block scales [batch, ceil(len / 128), heads] (q's per
    query head, k's and v's per K/V head, `quantize_fp8`'s layout)."""
    batch, heads_kv = problem.batch, problem.nheads_kv
    if block_scaled(descales):
        blocks = lambda n: -(-n // BLOCK)  # noqa: E731
        want = ((batch, blocks(problem.max_seqlen_q), problem.nheads),
                (batch, blocks(problem.max_seqlen_k), heads_kv),
                (batch, blocks(problem.max_seqlen_k), heads_kv))
        kind = ("[batch, blocks of 128 queries, nheads]",
                "[batch, blocks of 128 keys, nheads_kv]", "[batch, blocks of 128 keys, nheads_kv]")
    else:
        want, kind = ((batch, heads_kv),) * 3, ("[batch, nheads_kv]",) * 3
    out = []
    for name, d, shape, what in zip(("q_descale", "k_descale", "v_descale"), descales, want,
                                    kind):
        if d is None:
            d = torch.ones(shape, dtype=torch.float32, device=device)
        elif tuple(d.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} here ({what}), got "
                             f"{list(d.shape)}")
        elif _reads_contents(d) and not bool((d > 0).all() and d.isfinite().all()):
            # A scale divides (V's block scales in O's rescale): 0, negative or not finite
            # would make O inf or NaN.
            raise ValueError(f"{name} must be positive and finite everywhere")
        out.append(d.contiguous())
    return tuple(out)


def _window(window_size) -> tuple:
    """(left, right): None for an unbounded side (None or negative)."""
    return tuple(None if w is None or w < 0 else int(w) for w in window_size)


def _traced_scales(descales, q, k, cu_seqlens_q) -> tuple:
    """The scales of a traced call: FA3's descales where None become 1.0 from the shapes;
    block scales must all be given (their block counts come from the lengths)."""
    if block_scaled(descales):
        if any(d is None for d in descales):
            raise ValueError("under torch.compile, pass all three block scales")
        return tuple(descales)
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    return tuple(torch.ones(batch, k.shape[-2], dtype=torch.float32, device=q.device)
                 if d is None else d for d in descales)


def _problem(q, k, v, lengths, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
             softcap, pack_gqa, num_splits, page_table):
    """The call's validated `AttentionProblem` (a paged cache as the K and V it stands for)."""
    cu_q, cu_k, used_q, used_k = lengths
    kv, cu_view = (k, v), cu_k
    if page_table is not None:
        from flash_cute.runtime.call import paged_view

        *kv, cu_view = paged_view(q, k, v, lengths, page_table, False)
    return validate_attention_inputs(
        q, *kv, softmax_scale=softmax_scale, causal=causal, window_size=window,
        softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_view, seqused_q=used_q,
        seqused_k=used_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        pack_gqa=pack_gqa, num_splits=num_splits, supported_dtypes=FP8_DTYPES,
        supported_hdims=FP8_HDIMS, require_cuda=False)


def _reads_contents(t) -> bool:
    """Whether a scale's values are read on the host: CPU tensors always, CUDA ones with
    `check_inputs` on (it costs a device sync), never a trace's."""
    from flash_cute.runtime import plans

    if torch.compiler.is_compiling() or type(t) is not torch.Tensor:
        return False
    return t.device.type == "cpu" or plans.content_check_on()


def _describe(d) -> str:
    if isinstance(d, torch.Tensor):
        return f"{d.dtype} of shape {list(d.shape)}"
    return type(d).__name__


def flash_attn_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None,
                   softmax_scale=None, causal: bool = False, window_size=(-1, -1),
                   softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
                   pack_gqa=None, num_splits: int = 1, page_table=None,
                   out_dtype=torch.bfloat16, return_lse: bool = False, arch=None):
    """Attention over float8_e4m3fn q [b, sq, h, d] (varlen: [tq, h, d] with cu_seqlens),
    k and v [b, sk, hk, d]: O = softmax(q kᵀ · softmax_scale · q_descale · k_descale) v ·
    v_descale, in `out_dtype`. Descales are float32 [b, hk] (None: 1.0), FA3's convention:
    the value a tensor was divided by before its cast to e4m3. Or block scales, one per 128
    tokens of a head: float32 [b, ceil(sq / 128), h] for q and [b, ceil(sk / 128), hk] for k
    and v (varlen: by the position in the sequence, ceil(max_seqlen / 128) blocks), as
    `quantize_fp8` returns them (``block=None`` there gives per-(batch, head) ones). Returns
    O, or (O, LSE) with `return_lse`.

    ``num_splits`` (split-KV, FA4's meaning: 1 none, 0 the heuristic) and ``page_table``
    (int32 [b, max_pages]: k, v are paged caches [pages, page_size, hk, d] whose used rows
    ``seqused_k`` gives) serve decode.

    CUDA runs the Hopper FP8 kernel (``arch``: a pipeline by name, refused unless it has the
    FP8 forward); CPU tensors run its emulation.

    Args:
        q: float8_e4m3fn (or e5m2) [b, sq, h, d]; varlen [tq, h, d].
        k: like q, [b, sk, hk, d] (hk dividing h); paged [pages, page_size, hk, d].
        v: like k.
        q_descale: float32 [b, hk] (None: 1.0), or block scales [b, ceil(sq / 128), h].
        k_descale: float32 [b, hk], or [b, ceil(sk / 128), hk].
        v_descale: as k_descale.
        softmax_scale: the scores' scale (default 1 / sqrt(d)).
        causal: the causal mask, aligned bottom-right.
        window_size: (left, right), -1 for an unbounded side.
        softcap: > 0: cap · tanh(S / cap) (per-(batch, head) descales only).
        cu_seqlens_q: int32 [b + 1], varlen q.
        cu_seqlens_k: int32 [b + 1], varlen k and v.
        max_seqlen_q: the longest query sequence (varlen).
        max_seqlen_k: the longest key sequence (varlen).
        seqused_q: int32 [b], query rows used per sequence.
        seqused_k: int32 [b], key rows used per sequence.
        pack_gqa: tile a K/V head's query heads together (None: the pipeline decides).
        num_splits: split-KV: 1 none, 0 the heuristic, n > 1 that many.
        page_table: int32 [b, max_pages] for paged k and v.
        out_dtype: torch.bfloat16 (default) or torch.float16.
        return_lse: also return the LSE, float32 [b, h, sq].
        arch: a pipeline by name, or None for dispatch's choice.

    Returns:
        O in `out_dtype`, q's shape with v's head dim; or (O, LSE) with `return_lse`.

    Raises:
        TypeError: inputs that are not FP8, mixed FP8 types, an `out_dtype` or descales of
            the wrong dtype.
        ValueError: descales of the wrong shape or device, not positive and finite, or a mix
            of descales and block scales.
        NotImplementedError: gradients asked for (forward only), block scales with softcap,
            a head dim or pipeline without the FP8 forward."""
    descales = (q_descale, k_descale, v_descale)
    check_fp8_inputs(q, k, v, descales, out_dtype)
    if block_scaled(descales) and softcap:
        raise NotImplementedError("block scales with softcap: use FA3's per-(batch, K/V head) "
                                  "descales, or no softcap")
    lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    window = _window(window_size)
    if torch.compiler.is_compiling():
        # Validated by the operator (its fake implementation, while tracing).
        scales = _traced_scales(descales, q, k, cu_seqlens_q)
    else:
        problem = _problem(q, k, v, lengths, max_seqlen_q, max_seqlen_k, softmax_scale,
                           causal, window, softcap, pack_gqa, num_splits, page_table)
        scales = _scales(descales, problem, q.device)
        if _eager(q, k, v):
            out, lse = _cuda(q, k, v, problem, scales, out_dtype, lengths, page_table, arch)
            return (out, lse) if return_lse else out
    # The operator: CPU tensors (the emulation), torch.compile and fake tensors.
    out, lse = torch.ops.flash_cute.fwd_fp8(
        q, k, v, *lengths, *scales, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        *window, float(softcap), pack_gqa, num_splits, page_table, out_dtype, arch)
    return (out, lse) if return_lse else out


def _eager(*tensors) -> bool:
    """Plain CUDA tensors outside a trace or dispatch mode: the kernel is called directly
    (the operator's boxed call costs host time, as for the 16-bit forward)."""
    if not all(type(t) is torch.Tensor and t.is_cuda for t in tensors):
        return False
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())


def _cuda(q, k, v, problem, scales, out_dtype, lengths, page_table=None, arch=None):
    from flash_cute.arch.hopper.planner import plan_forward_fp8
    from flash_cute.runtime.dispatch import choose_pipelines

    # Refuses, by name, a pipeline without the FP8 forward (`descriptor.FP8`).
    pipeline, _ = choose_pipelines(q.device, arch, problem)
    assert pipeline.name == "hopper", pipeline.name
    launch = plan_forward_fp8(q, k, v, problem, *lengths, out_dtype=out_dtype,
                              page_table=page_table, block_scales=scales[0].dim() == 3)
    return launch(q, k, v, *lengths, page_table=page_table, descales=scales)


def _cpu(q, k, v, problem, scales, out_dtype, lengths, page_table=None):
    """The kernel's emulation (`emulate` with per-(batch, K/V head) scales), one sequence at
    a time: varlen or padded, seqused, windows, softcap, paged caches gathered first."""
    cu_q, cu_k, used_q, used_k = lengths
    if page_table is not None:
        from flash_cute.runtime import paging

        k, v = paging.gather(k, v, page_table)
    group = problem.nheads // problem.nheads_kv
    q_scale, k_scale, v_scale = scales
    block = BLOCK if q_scale.dim() == 3 else None
    if block is None:
        q_scale = q_scale.repeat_interleave(group, dim=1)
    out = torch.zeros(*q.shape[:-1], problem.hdim_v, dtype=out_dtype)
    lse = torch.full((problem.nheads, q.shape[0]) if problem.varlen
                     else (problem.batch, problem.nheads, q.shape[1]), -math.inf)
    for b in range(problem.batch):
        q0, q1 = (int(cu_q[b]), int(cu_q[b + 1])) if cu_q is not None else (0, q.shape[1])
        k0, k1 = (int(cu_k[b]), int(cu_k[b + 1])) if cu_k is not None else (0, k.shape[1])
        q1 = q0 + int(used_q[b]) if used_q is not None else q1
        k1 = k0 + int(used_k[b]) if used_k is not None else k1
        if q1 <= q0:
            continue
        rows = (lambda t, a, z: t[a:z][None]) if problem.varlen else \
            (lambda t, a, z, b=b: t[b:b + 1, a:z])
        keys = (lambda t, a, z: t[a:z][None]) if cu_k is not None else \
            (lambda t, a, z, b=b: t[b:b + 1, a:z])
        o, l_b = emulate(rows(q, q0, q1), keys(k, k0, k1), keys(v, k0, k1), q_scale[b:b + 1],
                         k_scale[b:b + 1], v_scale[b:b + 1], causal=problem.causal,
                         softmax_scale=problem.softmax_scale,
                         window_size=(problem.window_left, problem.window_right),
                         softcap=problem.softcap, block=block)
        if problem.varlen:
            out[q0:q1] = o[0].to(out_dtype)
            lse[:, q0:q1] = l_b[0]
        else:
            out[b, q0:q1] = o[0].to(out_dtype)
            lse[b, :, q0:q1] = l_b[0]
    return out, lse
