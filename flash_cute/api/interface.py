"""Public API: `flash_attn_func` and `flash_attn_varlen_func`, with flash_attn.cute's names,
layouts and return convention ``(out, lse)``, and their autograd. They call the operators
``torch.ops.flash_cute.fwd`` / ``bwd`` (`flash_cute.api.ops`), whose CUDA implementation plans
each call once (`flash_cute.runtime.plans`).

Which pipeline runs a call is `flash_cute.runtime.dispatch`'s choice (the newest that runs on the
device and has the capabilities the problem needs); ``arch=`` forces one (e.g.
``arch="ampere"`` runs the sm80 pipeline on a Hopper GPU, for per-arch comparison), which then
refuses, before any launch, what it lacks.
"""

from typing import Optional, Tuple

import torch

from flash_cute.api import ops  # noqa: F401 - registers torch.ops.flash_cute
from flash_cute.api.params import document
from flash_cute.reference.rng import draw_seed
from flash_cute.runtime import paging, plans  # noqa: F401 - ops registers torch.ops.flash_cute
from flash_cute.runtime.cache_contents import check_page_entries, host_copies
from flash_cute.runtime.checks import check_dropout_p, is_fake, normalize_mask, real
from flash_cute.runtime.plans import check_inputs, clear_plans  # noqa: F401 - public here
from flash_cute.runtime.problem import check_splits, validate_attention_inputs
from flash_cute.variants import derivative, registry


class _FlashAttnFunc(torch.autograd.Function):
    """Autograd around the operators (a Python Function is cheaper per call than the
    operator's own registered autograd, which direct callers of torch.ops.flash_cute.fwd
    get)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, options, variant,
                dropout_p, rng_seed, splits, *learned):
        """`learned`: the mods' learnable captured tensors (`derivative.learnable`), inputs
        here so that their gradients reach them."""
        fwd = plans.forward if _eager(q, k, v) else torch.ops.flash_cute.fwd
        out, lse = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *options,
                       True, variant, dropout_p, rng_seed, *splits)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                              seqused_k, rng_seed)
        ctx.options, ctx.variant, ctx.dropout_p = options, variant, dropout_p
        # The mods' registry entry lives as long as what it was built from: kept here for the
        # backward (a block mask built inline in the call is gone by then).
        ctx.holders = registry.holders(variant)
        ctx.learned = len(learned)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *lengths, rng_seed = ctx.saved_tensors
        # dlse is None unless the loss used the LSE (grads are not materialized).
        if dout is None:
            dout = torch.zeros_like(out)
        bwd = plans.backward if _eager(dout, q, out) else torch.ops.flash_cute.bwd
        dq, dk, dv, dmods = bwd(dout, dlse, q, k, v, out, lse, *lengths, *ctx.options,
                                ctx.variant, ctx.dropout_p, rng_seed, ctx.learned > 0)
        grads = _not_differentiable(dq, dk, dv, *dmods)
        return grads[:3] + (None,) * 9 + grads[3:]


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
    block_mask=None,
    page_table: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Exact attention on [batch, seqlen, nheads, hdim] tensors; returns ``(out, lse)``.

    The parameters are flash_attn.cute's (flash-attn 4.0.0b36), in its order, so positional
    calls work too; `arch` (keyword-only) is flash-cute's own. Those with no kernel here yet
    (qv, gathered K/V) raise NotImplementedError naming the feature. ``learnable_sink`` (FA4's:
    one logit per query head joining each row's softmax, with its gradient) is folded into
    the result (`fold_sink`). FA4-form mods (`flash_cute.blocks.fa4_mods`: ``@cute.jit`` functions
    with ``score_mod_bwd``, ``aux_tensors`` and ``aux_scalars``, Int32 / Float32 values passed
    to the kernels as parameters) run in the GPU kernels. FA4's ``block_sparse_tensors``
    (forward, query-major) are read as a block mask (`block_mask.from_fa4`), with either form
    of mods; ``block_sparse_tensors_bwd`` describes the same mask, which the backward kernels
    derive from the forward's, so it is accepted and not read.

    ``num_splits`` (split-KV, FA4's meaning): 1 (the default) no split; 0 or below the
    heuristic (`flash_cute.runtime.splits`), which splits the keys where the query tiles are too few
    to fill the GPU (decode); n > 1 n splits. Each split writes an fp32 partial and the LSE
    merge combines them; the result agrees with the unsplit one to fp32 rounding.

    ``lse`` is [batch, nheads, seqlen_q] fp32 (natural log), ``None`` unless `return_lse` or a
    backward pass needs it. Masks are bottom-right aligned; ``window_size=(left, right)`` with
    None (or a negative int) for an unbounded side; GQA/MQA when k/v have fewer heads.

    ``score_mod`` / ``mask_mod``: FlexAttention's functions (`flash_cute.variants.mod_graph`);
    ``alibi_slopes`` (keyword-only): flash_attn 2's ALiBi, fp32 [nheads] or [batch, nheads];
    ``page_table`` (keyword-only): k / v are paged caches, as in `flash_attn_varlen_func`
    (every row of each sequence's pages is a key);
    ``block_mask`` (keyword-only, flash-cute's own): a FlexAttention `BlockMask`
    (`flash_cute.create_block_mask`), with its meaning (`flash_cute.variants.block_mask`). The mods
    run in the hopper and ampere kernels, forward and backward (`flash_cute.blocks.graph_mods`;
    examples in `flash_cute.variants.examples`), block masks too
    (`flash_cute.variants.block_mask.kernel_tiles`).

    ``dropout_p`` (keyword-only, flash-cute's own; FA4 has none): dropout of the attention
    weights in the kernels, forward and backward, FA2's semantics (kept weights scaled by
    1 / (1 - p); the LSE is the undropped softmax's). Each call draws a 64-bit seed from
    torch's generator of q's device, so torch.manual_seed reproduces the mask bit for bit and
    CUDA-graph replays draw fresh ones; an element is kept with probability exactly
    ``flash_cute.reference.rng.keep_probability(p)`` (16 random bits per element, within 2^-17 of
    1 - p). The mask itself is not returned. Dropout turns packed GQA off.

    ``pack_gqa`` (GQA/MQA forward): tile the query heads that share a K/V head together, so
    short query sequences (decode) fill a tile and K/V are read once per group. None lets the
    pipeline decide (`flash_cute.runtime.launch.packed_heads`); True requires it
    (NotImplementedError where the pipeline cannot: the ampere pipeline, or a group that does not
    divide the hopper tile's 128 rows); False never packs. The result is the same either way.

    FP8 (keyword-only, FA3's): float8_e4m3fn q, k and v with ``q_descale`` / ``k_descale`` /
    ``v_descale`` (float32 [batch, nheads_kv], None: 1.0) run the FP8 forward
    (`flash_cute.fp8.flash_attn_fp8`), forward only, its O in ``out_dtype`` (bf16 unless
    torch.float16).
    """
    if _fp8_call(q, k, v, q_descale, k_descale, v_descale, out_dtype):
        _refuse_for_fp8(locals())
        return _fp8(q, k, v, q_descale, k_descale, v_descale, out_dtype, return_lse,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, pack_gqa=pack_gqa, num_splits=num_splits,
                    page_table=page_table, arch=arch)
    if (qv is not None or gather_kv_indices is not None or gather_bwd_recompute_p
            or gather_bwd_token_chunk is not None):
        _refuse_unbuilt(locals())
    if page_table is not None:   # keys: every row of each sequence's pages
        # A block mask covers the logical keys: read through gathered pages.
        sparse = block_mask is not None or block_sparse_tensors is not None
        k, v, page_table = _paged(k, v, page_table, None, q, gather=sparse)
    if block_sparse_tensors is not None:
        # FA4's block sparsity: the forward's tensors as a block mask; its backward tensors
        # describe the same mask, which the kernels re-derive (`block_mask.kernel_tiles`).
        if block_mask is not None:
            raise ValueError("pass block_mask or block_sparse_tensors, not both")
        from flash_cute.variants.block_mask import from_fa4

        block_mask = from_fa4(block_sparse_tensors, q.shape[1], k.shape[1])
    variant = 0
    if (score_mod is not None or mask_mod is not None or block_mask is not None
            or alibi_slopes is not None or score_mod_bwd is not None
            or aux_tensors is not None or aux_scalars is not None):
        if block_mask is not None:
            _check_block_mask(block_mask, q, k)
        variant = _variant_key(score_mod, mask_mod, softcap, block_mask, alibi_slopes,
                               q.shape[0], q.shape[2], score_mod_bwd, aux_tensors,
                               aux_scalars)
    return _attention(q, k, v, (None, None, None, None), None, None, softmax_scale, causal,
                      window_size, softcap, pack_gqa, deterministic, arch, return_lse, variant,
                      dropout_p, (num_splits, None), page_table, sink=learnable_sink)


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
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Attention over sequences of different lengths; returns ``(out, lse)``.

    The parameters are flash_attn.cute's, in its order (the fourth is `qv`: pass cu_seqlens
    by keyword or after it), as in `flash_attn_func`; `min_seqlen_k` and
    `disable_scheduler_metadata` are scheduling hints, accepted and not needed here; a
    scheduler_metadata raises NotImplementedError. ``num_splits`` as in `flash_attn_func`;
    ``seqlen_k_per_split`` (FA4's): each split covers that many keys (a multiple of the
    kernel's tile_n, which the ValueError names otherwise) from key 0 of every sequence, so
    that a sequence's output is bitwise the same whatever else is in the batch and however
    many splits run (num_splits 0 then picks at least as many as the longest sequence needs;
    n > 1 must be enough; 1 runs unsplit, as in FA4). ``page_table``
    (int32 [batch, max_pages]) takes k / v as paged caches [num_pages, page_size, heads_kv, d]:
    sequence b's keys are its pages in order, ``seqused_k[b]`` of them used. The hopper
    forward reads the pages itself (TMA boxes of gcd(tile_n, page_size) rows, page sizes
    powers of two from 8); other pipelines, smaller pages and calls that need gradients
    gather the pages with torch operations first (differentiable into the cache). Page
    indices are clamped into the cache either way (`flash_cute.runtime.paging`).

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
    (docs/guide/reliability.md). Causal and local masks align bottom-right to the *used*
    lengths. Query rows past seqused_q[b] get out = 0 and lse = -inf, as a row that sees no
    key (flash-attn leaves them unwritten, so any value there meets its contract), and
    dq = 0; keys past seqused_k[b] get dk = dv = 0. ``pack_gqa`` as in `flash_attn_func`.

    * mixed: cu_seqlens for one side only, the other padded [batch, seqlen, heads, d] (a
      packed prompt against a padded KV cache, or the reverse), each side with or without its
      seqused. The output and lse take the layout of q's side.

    FP8: float8_e4m3fn q, k, v with FA3's descales, as in `flash_attn_func` (packed or
    padded on both sides, seqused, paged caches, splits).
    """
    if _fp8_call(q, k, v, q_descale, k_descale, v_descale, out_dtype):
        _refuse_for_fp8(locals())
        return _fp8(q, k, v, q_descale, k_descale, v_descale, out_dtype, return_lse,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, pack_gqa=pack_gqa, num_splits=num_splits,
                    page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                    arch=arch)
    if (qv is not None or gather_kv_indices is not None
            or block_sparse_tensors is not None or scheduler_metadata is not None
            or gather_bwd_recompute_p or gather_bwd_token_chunk is not None):
        _refuse_unbuilt(locals())
    variant = 0
    if (score_mod is not None or mask_mod is not None or alibi_slopes is not None
            or score_mod_bwd is not None or aux_tensors is not None or aux_scalars is not None):
        batch = (cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None
                 else cu_seqlens_k.shape[0] - 1 if cu_seqlens_k is not None else q.shape[0])
        variant = _variant_key(score_mod, mask_mod, softcap, None, alibi_slopes, batch,
                               q.shape[-2], score_mod_bwd, aux_tensors, aux_scalars)

    if page_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError("page_table describes each sequence's keys by its pages: pass "
                             "seqused_k for their lengths, not cu_seqlens_k")
        k, v, page_table = _paged(k, v, page_table, cu_seqlens_q, q, seqused_k=seqused_k)
        if max_seqlen_k is None:
            max_seqlen_k = k.shape[1] if page_table is None else page_table.shape[1] * k.shape[1]
    q_padded = None
    if (cu_seqlens_q is None) != (cu_seqlens_k is None) and page_table is None:
        # One side packed, the other padded: the padded side is packed too, as sequences of
        # its padded length (a view when its batch and sequence dims merge).
        if cu_seqlens_q is None:
            q_padded = q.shape
            q, cu_seqlens_q, max_seqlen_q = _pack_padded("q", q, cu_seqlens_k, max_seqlen_q)
        else:
            k, cu_seqlens_k, max_seqlen_k = _pack_padded("k", k, cu_seqlens_q, max_seqlen_k)
            v = _pack_padded("v", v, cu_seqlens_q, max_seqlen_k)[0]

    out, lse = _attention(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),
                          max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                          softcap, pack_gqa, deterministic, arch, return_lse, variant,
                          dropout_p, (num_splits, seqlen_k_per_split), page_table,
                          sink=learnable_sink)
    if q_padded is not None:
        batch, seqlen = q_padded[:2]
        out = out.view(batch, seqlen, *out.shape[1:])
        if lse is not None:
            lse = lse.view(lse.shape[0], batch, seqlen).transpose(0, 1).contiguous()
    return out, lse


def _fp8_call(q, k, v, q_descale, k_descale, v_descale, out_dtype) -> bool:
    """Whether a call is FP8's: an e4m3 input, or a descale or out_dtype given (which 16-bit
    inputs refuse: their result is in their own dtype, unscaled)."""
    from flash_cute.fp8.attention import is_fp8

    if any(is_fp8(t) for t in (q, k, v)):
        return True
    given = [n for n, x in (("q_descale", q_descale), ("k_descale", k_descale),
                            ("v_descale", v_descale), ("out_dtype", out_dtype)) if x is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to float8_e4m3fn q, k and v only; got "
                         f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    return False


# What the FP8 forward leaves out, by argument: (the value it must keep, the name in errors).
_FP8_REFUSED = {"qv": None, "gather_kv_indices": None, "learnable_sink": None,
                "score_mod": None, "score_mod_bwd": None, "mask_mod": None, "aux_tensors": None,
                "aux_scalars": None, "block_sparse_tensors": None, "block_mask": None,
                "alibi_slopes": None, "dropout_p": 0.0, "deterministic": False,
                "seqlen_k_per_split": None, "scheduler_metadata": None,
                "gather_bwd_recompute_p": False, "gather_bwd_token_chunk": None}


def _refuse_for_fp8(args: dict) -> None:
    """NotImplementedError naming each argument the FP8 forward does not take."""
    used = [name for name, default in _FP8_REFUSED.items()
            if name in args and args[name] is not default and args[name] != default]
    if used:
        raise NotImplementedError(f"the FP8 forward has no {', '.join(used)}: call with bf16 "
                                  f"or fp16 q, k and v for them")


def _fp8(q, k, v, q_descale, k_descale, v_descale, out_dtype, return_lse, **kw):
    """(out, lse or None) of `flash_cute.fp8.flash_attn_fp8`."""
    from flash_cute.fp8.attention import flash_attn_fp8

    out, lse = flash_attn_fp8(q, k, v, q_descale, k_descale, v_descale,
                              out_dtype=out_dtype or torch.bfloat16, return_lse=True, **kw)
    return out, (lse if return_lse else None)


def _pages_in_kernel(q, k, v) -> bool:
    """Whether a paged call hands its pages to the kernels (which gather the blocks
    themselves, or fall back to `paging.gather` where they cannot): CUDA tensors and no
    gradient (a backward into pages runs through the differentiable gather instead)."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _paged(k_cache, v_cache, page_table, cu_seqlens_q, q, gather: bool = False,
           seqused_k=None):
    """(k, v, page_table for the operator): the cache and its table as they are, or the
    padded keys and values the table names (`paging.gather`) and None (always so with
    `gather`). A gathered table's used entries are checked here (`check_page_entries`): on
    the CPU always, on CUDA with the content check on (the operator checks the others)."""
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    paging.check_paged(k_cache, v_cache, page_table, batch)
    if not gather and _pages_in_kernel(q, k_cache, v_cache):
        return k_cache, v_cache, page_table
    if _reads_contents(page_table, seqused_k):
        table, used = host_copies(page_table, seqused_k)
        check_page_entries("page_table", table, *k_cache.shape[:2], used, "seqused_k")
    k, v = paging.gather(k_cache, v_cache, page_table)
    return k, v, None


def _reads_contents(*tensors) -> bool:
    """Whether a call's index tensors are read on the host: CPU tensors always, CUDA ones
    with `check_inputs(True)`, never a trace's."""
    given = [t for t in tensors if t is not None]
    if torch.compiler.is_compiling() or any(map(is_fake, given)):
        return False
    return plans.content_check_on() or all(t.device.type == "cpu" for t in given)


# Uniform cu_seqlens [0, s, 2s, ..., bs] by (batch, seqlen, device): a padded side of a mixed
# call reuses one instead of launching an arange per call.
_UNIFORM_CU = {}


def _pack_padded(name: str, t: torch.Tensor, other_cu: torch.Tensor, max_seqlen):
    """A padded [batch, seqlen, heads, d] side of a call whose other side is packed, as a
    packed [batch * seqlen, heads, d] one: (tensor, cu_seqlens, max_seqlen)."""
    side = "q" if name == "q" else "k"
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name} must be padded [batch, seqlen, heads, d] when cu_seqlens_{side} is None "
            f"and the other side is packed, got {name}.shape={got}")
    batch, seqlen = t.shape[:2]
    if isinstance(other_cu, torch.Tensor) and other_cu.dim() == 1 \
            and other_cu.shape[0] != batch + 1:
        other = "k" if side == "q" else "q"
        raise ValueError(
            f"{name} is padded with batch {batch}, but cu_seqlens_{other} has "
            f"{other_cu.shape[0]} entries (batch + 1 = {batch + 1} needed)")
    key = (batch, seqlen, t.device)
    cu = None if torch.compiler.is_compiling() else _UNIFORM_CU.get(key)
    if cu is None:
        if len(_UNIFORM_CU) > 64:
            _UNIFORM_CU.clear()
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=t.device)
        if not torch.compiler.is_compiling() and type(cu) is torch.Tensor:
            _UNIFORM_CU[key] = cu
    return t.reshape(batch * seqlen, *t.shape[2:]), cu, seqlen if max_seqlen is None \
        else max_seqlen


# flash_attn.cute's parameters with no kernel here yet, and what brings them (NotImplementedError
# names them; they never raise TypeError, so FA4 code runs up to the feature it needs).
_UNBUILT = {
    "qv": "MLA's qv operand", "gather_kv_indices": "gathered K/V (top-k attention)",
    "block_sparse_tensors": "block sparsity with varlen (FA4 has none either)",
    "scheduler_metadata": "scheduler_metadata",
    "gather_bwd_recompute_p": "gather_bwd_recompute_p", "gather_bwd_token_chunk":
    "gather_bwd_token_chunk",
}


def _variant_key(score_mod, mask_mod, softcap, block_mask=None, alibi_slopes=None, batch=None,
                 heads=None, score_mod_bwd=None, aux_tensors=None, aux_scalars=None) -> int:
    forms = {_form(name, fn) for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))
             if fn is not None}
    if ("fa4" in forms or score_mod_bwd is not None or aux_tensors is not None
            or aux_scalars is not None):
        return _fa4_key(score_mod, mask_mod, softcap, block_mask, alibi_slopes, score_mod_bwd,
                        aux_tensors, forms, aux_scalars)
    if alibi_slopes is not None:
        if softcap:
            # ALiBi is a score mod in the kernels, which then take no softcap of their own.
            raise ValueError("softcap with alibi_slopes: the two do not combine here; write "
                             "both in one score_mod (cap * torch.tanh(score / cap) minus the "
                             "bias)")
        return _alibi_key(alibi_slopes, score_mod, mask_mod, block_mask, batch, heads)
    if torch.compiler.is_compiling():
        # A trace cannot trace the tracer: the mods must have been registered already (a
        # first eager call, or `flash_cute.variants.mod_graph.register`).
        key = registry.registered(score_mod, mask_mod, block_mask)
        if key is None:
            raise RuntimeError("score_mod / mask_mod under torch.compile: register them first "
                               "with flash_cute.variants.mod_graph.register(score_mod, mask_mod) "
                               "(or make one eager call)")
        return key
    return _checked_variant_key(score_mod, mask_mod, softcap, block_mask)


def _alibi_key(slopes, score_mod, mask_mod, block_mask, batch, heads) -> int:
    """FlashAttention-2's ALiBi (fp32 [nheads] or [batch, nheads]) as a built-in score mod."""
    if score_mod is not None:
        raise NotImplementedError("alibi_slopes with a score_mod: write the bias in the mod")
    if torch.compiler.is_compiling():
        raise NotImplementedError("alibi_slopes under torch.compile: not built yet")
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 \
            or tuple(slopes.shape) not in ((heads,), (batch, heads)):
        got = (f"{slopes.dtype} {tuple(slopes.shape)}" if isinstance(slopes, torch.Tensor)
               else type(slopes).__name__)
        raise ValueError(f"alibi_slopes must be fp32 [nheads={heads}] or [batch={batch}, "
                         f"nheads={heads}], got {got}")
    return registry.register_alibi(slopes, mask_mod, block_mask)


def _check_block_mask(block_mask, q, k) -> None:
    """A FlexAttention BlockMask of this call's [batch, heads, seqlen_q, seqlen_k] (its batch
    and heads may be 1, broadcast)."""
    shape = getattr(block_mask, "shape", None)
    if shape is None or not hasattr(block_mask, "kv_indices"):
        raise TypeError(f"block_mask must be a torch FlexAttention BlockMask "
                        f"(flash_cute.create_block_mask), got {type(block_mask).__name__}")
    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    b, h, sq, sk = shape
    if b not in (1, batch) or h not in (1, heads) or sq != seqlen_q or sk != k.shape[1]:
        raise ValueError(f"block_mask covers [{b}, {h}, {sq}, {sk}], but the call is [batch "
                         f"{batch}, heads {heads}, seqlen_q {seqlen_q}, seqlen_k {k.shape[1]}] "
                         "(batch and heads may be 1)")


def _form(name: str, fn) -> str:
    """"flex" (FlexAttention's parameters: score, b, h, q_idx, kv_idx) or "fa4" (FA4's, with
    seqlen_info and aux_tensors after them, and aux_scalars where the call passes them) for a
    score_mod or mask_mod."""
    import inspect

    arity = 5 if name == "score_mod" else 4
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "flex"
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return "flex"
    if len(params) == arity:
        return "flex"
    if len(params) in (arity + 2, arity + 3):
        return "fa4"
    raise TypeError(f"{name} takes {len(params)} parameters: FlexAttention's form has {arity} "
                    f"({'score, ' if arity == 5 else ''}b, h, q_idx, kv_idx), FA4's {arity + 2} "
                    f"(then seqlen_info, aux_tensors) or {arity + 3} (then aux_scalars)")


def _fa4_key(score_mod, mask_mod, softcap, block_mask, alibi_slopes, score_mod_bwd,
             aux_tensors, forms, aux_scalars=None) -> int:
    """The registry key of FA4-form mods (`flash_cute.blocks.fa4_mods`), which run in the GPU
    kernels only; `aux_scalars` (FA4's) reach them as kernel parameters."""
    if score_mod_bwd is not None and (score_mod is None or "fa4" not in forms):
        raise ValueError("score_mod_bwd goes with an FA4-form score_mod (FlexAttention-form "
                         "mods get their derivative from the traced graph)")
    for name, value in (("aux_tensors", aux_tensors), ("aux_scalars", aux_scalars)):
        if value is not None and "fa4" not in forms:
            raise ValueError(f"{name} go with FA4-form mods; FlexAttention-form mods capture "
                             "their tensors and constants")
    if forms - {"fa4"}:
        raise ValueError("score_mod and mask_mod mix FlexAttention's form and FA4's: write "
                         "both in one form")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes with FA4-form mods: not built yet (write ALiBi "
                                  "in the score_mod)")
    if score_mod is not None and softcap:
        raise ValueError("softcap with a score_mod: write the softcap inside the mod")
    if torch.compiler.is_compiling():
        raise NotImplementedError("FA4-form mods under torch.compile: not built yet")
    return registry.register_fa4(score_mod, mask_mod, score_mod_bwd, aux_tensors, aux_scalars,
                                  block_mask)


def _checked_variant_key(score_mod, mask_mod, softcap, block_mask=None) -> int:
    """The registry key of FlexAttention-form mods (`flash_cute.variants.tracer`)."""
    key = registry.registered(score_mod, mask_mod, block_mask)
    if key is not None and not (score_mod is not None and softcap):
        return key   # checked when it was registered
    if score_mod is not None and softcap:
        raise ValueError("softcap with a score_mod: write the softcap inside the mod "
                         "(cap * torch.tanh(score / cap))")
    return registry.register(score_mod, mask_mod, block_mask)


def _refuse_unbuilt(args: dict) -> None:
    for name, what in _UNBUILT.items():
        value = args.get(name)
        if value is not None and value is not False:
            raise NotImplementedError(f"{name}: {what} is not built in flash-cute yet")


def _attention(q, k, v, lengths: tuple, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size, softcap, pack_gqa, deterministic, arch, return_lse, variant=0,
               dropout_p=0.0, splits=(1, None), page_table=None, append=None, sink=None):
    """Both public functions' call of the operators. `lengths`: (cu_seqlens_q, cu_seqlens_k,
    seqused_q, seqused_k), each a tensor or None; `splits`: (num_splits, seqlen_k_per_split);
    `page_table`: k and v are paged caches read through it (no gradient: `_paged`);
    `append`: (k_new, v_new) the kernel writes into the cache first (`attend_and_append`);
    `sink`: FA4's learnable_sink, folded into the result (`fold_sink`).
    With dropout the call's seed is drawn here, from torch's generator of q's device
    (`rng.draw_seed`)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        validate_attention_inputs(q, k, v)  # raises, naming the argument
    if sink is not None:
        check_sink(sink, q)
        out, lse = _attention(q, k, v, lengths, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal, window_size, softcap, pack_gqa, deterministic, arch, True,
                              variant, dropout_p, splits, page_table)
        out, lse = fold_sink(out, lse, sink, lengths[0] is not None)
        return out, (lse if return_lse else None)
    options = _options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                       pack_gqa, deterministic, arch)
    dropout_p, rng_seed = _dropout(dropout_p, q)
    splits = check_splits(*splits)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)
    learned = _learned(variant)
    if learned and page_table is not None and append is None:
        # Their gradients run on gathered K/V, as `_paged` gathers when q, k or v need one.
        k, v = paging.gather(k, v, page_table)
        page_table = None
    if needs_grad or learned:
        out, lse = _FlashAttnFunc.apply(q, k, v, *lengths, options, variant, dropout_p, rng_seed,
                                        splits, *learned)
        return out, lse
    if append is not None:
        out, lse = plans.forward(q, k, v, *lengths, *options, False, variant, dropout_p,
                                 rng_seed, *splits, page_table, False, *append)
        return out, (lse if return_lse else None)
    fwd = plans.forward if _eager(q, k, v) else torch.ops.flash_cute.fwd
    out, lse = fwd(q, k, v, *lengths, *options, False, variant, dropout_p, rng_seed, *splits,
                   page_table)
    return out, (lse if return_lse else None)


def _learned(variant: int) -> tuple:
    """The call's learnable captured tensors (`derivative.learnable`) while autograd records:
    inputs of the autograd Function, so that their gradients reach them (under torch.compile
    too)."""
    if not variant or not torch.is_grad_enabled():
        return ()
    return derivative.learnable(registry.lookup(variant))


def check_sink(sink, q) -> None:
    """FA4's learnable_sink: one logit per query head, fp32/bf16/fp16, on q's device."""
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a tensor, got {type(sink).__name__}")
    if sink.shape != (q.shape[-2],):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({q.shape[-2]},), got "
                         f"{tuple(sink.shape)}")
    if sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink is on {sink.device}, q on {q.device}")


def fold_sink(out, lse, sink, varlen: bool) -> tuple:
    """(O, LSE) with a learnable sink: one more softmax column per query head, of logit
    sink[h] (natural log, not scaled) and no value, folded into the attention's (O, LSE) as a
    merge of two partial softmaxes (`lse_merge`'s rule): LSE' = logaddexp(LSE, sink), O' =
    O · exp(LSE − LSE'). A row that sees no key gets O' = 0 and LSE' = sink, as in FA4.
    Torch operations, so autograd gives d(sink) = −Σ_rows exp(sink − LSE') · (Δ − dLSE') and
    carries dO and dLSE into the attention's backward (docs/decisions.md, D-SINK)."""
    # float32 at least (float64 where the LSE is: a context-parallel float64 check).
    dtype = torch.promote_types(lse.dtype, torch.float32)
    s = sink.to(dtype)
    s = s[:, None] if varlen else s[None, :, None]
    merged = torch.logaddexp(lse.to(dtype), s)
    weight = torch.where(lse == float("-inf"), torch.zeros_like(merged), torch.exp(lse - merged))
    weight = weight.transpose(0, 1) if varlen else weight.transpose(1, 2)
    return (out.to(dtype) * weight[..., None]).to(out.dtype), merged


def attend_and_append(q, k_cache, v_cache, k_new, v_new, seqused_k, page_table=None,
                      softmax_scale=None, causal=False, softcap=0.0, num_splits=0,
                      return_lse=False, arch=None):
    """The decode step of `flash_attn_with_kvcache` in one kernel: q [b, sq, h, d] attends to
    the first seqused_k[b] rows of a padded (or, with page_table, paged) cache after the
    kernel wrote k_new / v_new [b, s_new, hk, d] (contiguous) into its last s_new of them.
    Eager CUDA calls with no gradient only: the operators, which torch.compile and the CPU
    run, take no append (`flash_attn_with_kvcache` appends with torch operations there).
    Every tile writes the new rows among the keys it visits before reading them
    (`flash_cute.blocks.kv_append`), so a mask that leaves a new row unseen by every query (a local
    window) would leave it unwritten: causal or no mask only."""
    if not _eager(q, k_cache, v_cache, k_new, v_new, seqused_k):
        raise ValueError("attend_and_append runs eager CUDA calls only")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache, k_new,
                                                                 v_new)):
        raise ValueError("attend_and_append has no backward: call it without gradients")
    # The cache, its pages and the new rows are checked when the call's plan is made
    # (`plans._make_plan`, `paging.check_append`).
    return _attention(q, k_cache, v_cache, (None, None, None, seqused_k), None, None,
                      softmax_scale, causal, (None, None), softcap, None, False, arch,
                      return_lse, splits=(num_splits, None), page_table=page_table,
                      append=(k_new, v_new))


def _dropout(dropout_p, q) -> tuple:
    """(dropout_p as a float, the call's seed or None)."""
    if dropout_p is None or (type(dropout_p) in (int, float) and dropout_p == 0):
        return 0.0, None
    p = check_dropout_p(dropout_p)
    return (p, draw_seed(q.device)) if p > 0 else (0.0, None)


def _eager(*tensors) -> bool:
    """Whether a call may skip the dispatcher and run the operators' CUDA implementation
    directly: plain CUDA tensors, no trace (torch.compile), no dispatch mode (fake tensors,
    opcheck, profilers' op counters), which all see the operator. The dispatcher's boxed
    call into Python costs more host time than the whole planned launch (docs/decisions.md,
    D-OPS)."""
    for t in tensors:
        if type(t) is not torch.Tensor or not t.is_cuda:
            return False
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())


_OPT_INT = (type(None), int, torch.SymInt)
_OPT_REAL = (type(None), int, float)
_OPT_BOOL = (type(None), bool)


def _options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, pack_gqa,
             deterministic, arch) -> tuple:
    """The operators' options, in their schema's order. Arguments of the schema's types pass
    as they are (a few type checks); others are converted where validation accepts them (a
    numpy int, a list window) and refused, with validation's message, where it does not."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        left = right = window_size
    if not (type(causal) is bool and type(left) in _OPT_INT and type(right) in _OPT_INT
            and type(softcap) in _OPT_REAL[1:] and type(softmax_scale) in _OPT_REAL
            and type(pack_gqa) in _OPT_BOOL and type(max_seqlen_q) in _OPT_INT
            and type(max_seqlen_k) in _OPT_INT and (arch is None or type(arch) is str)):
        causal, left, right = normalize_mask(causal, window_size)
        softcap = real("softcap", softcap)
        softmax_scale = None if softmax_scale is None else real("softmax_scale", softmax_scale)
        max_seqlen_q, max_seqlen_k = (None if m is None else int(m)
                                      for m in (max_seqlen_q, max_seqlen_k))
        if pack_gqa is not None and not isinstance(pack_gqa, bool):
            raise TypeError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
        if arch is not None and not isinstance(arch, str):
            raise TypeError(f"arch must be None or a pipeline name, got {arch!r}")
    return (max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right, softcap, pack_gqa,
            bool(deterministic), arch)


document(flash_attn_func)
document(flash_attn_varlen_func)
