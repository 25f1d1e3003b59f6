"""The public functions' parameters, described once: `document` appends an Args section (in
each function's own signature order) and a Raises section to a docstring, so the FA4-style
functions and the KV-cache one, which share most of their parameters, say the same of each."""

from __future__ import annotations

import inspect

PARAMS = {
    "q": "[batch, seqlen_q, nheads, hdim] (varlen: [total_q, nheads, hdim]), bf16 or fp16 "
         "(float8_e4m3fn / e5m2 for the FP8 forward).",
    "k": "[batch, seqlen_k, nheads_kv, hdim] (varlen: [total_k, ...]; paged: [num_pages, "
         "page_size, nheads_kv, hdim]), nheads_kv dividing nheads.",
    "v": "like k, with head dim hdim_v.",
    "k_cache": "[batch_cache, seqlen_cache, nheads_kv, hdim], or paged [num_pages, page_size, "
               "nheads_kv, hdim] with block_table.",
    "v_cache": "like k_cache, with head dim hdim_v.",
    "qv": "MLA's extra query operand: not built (NotImplementedError).",
    "cu_seqlens_q": "int32 [batch + 1], the packed query sequences' offsets.",
    "cu_seqlens_k": "int32 [batch + 1], the packed key sequences' offsets.",
    "max_seqlen_q": "the longest query sequence (varlen).",
    "max_seqlen_k": "the longest key sequence (varlen).",
    "min_seqlen_k": "FA4's scheduling hint, accepted and not needed.",
    "seqused_q": "int32 [batch]: query rows used per sequence.",
    "seqused_k": "int32 [batch]: key rows used per sequence.",
    "gather_kv_indices": "gathered K/V: not built (NotImplementedError).",
    "page_table": "int32 [batch, max_pages]: k and v are paged caches, sequence b's keys its "
                  "pages in order.",
    "block_table": "int32 [batch, max_pages] for a paged cache (flash-attn 2's name).",
    "softmax_scale": "the scores' scale (default 1 / sqrt(hdim)).",
    "causal": "the causal mask, aligned bottom-right.",
    "window_size": "(left, right) sliding window; None or a negative int for an unbounded "
                   "side.",
    "learnable_sink": "float32 [nheads]: FA4's per-head sink logit, with its gradient.",
    "softcap": "> 0: cap · tanh(S / cap) of the scaled scores; 0 off.",
    "num_splits": "split-KV: 1 none, 0 the heuristic, n > 1 that many splits.",
    "pack_gqa": "tile a K/V head's query heads together: None the pipeline decides, True "
                "required, False never.",
    "deterministic": "a bitwise reproducible backward (the pipelines that have it).",
    "score_mod": "FlexAttention's score_mod(score, b, h, q_idx, kv_idx), or FA4's @cute.jit "
                 "form.",
    "score_mod_bwd": "FA4's derivative of its score mod (generated when omitted).",
    "mask_mod": "FlexAttention's mask_mod(b, h, q_idx, kv_idx), or FA4's form.",
    "aux_tensors": "FA4's tensors that its mods read.",
    "aux_scalars": "FA4's Int32 / Float32 values its mods read (kernel parameters).",
    "block_sparse_tensors": "FA4's block sparsity, read as a block mask.",
    "block_sparse_tensors_bwd": "FA4's backward block sparsity: accepted, derived from the "
                                "forward's.",
    "return_lse": "return the LSE as well (it is always returned in the pair, None without "
                  "this unless a backward needs it).",
    "scheduler_metadata": "FA4's: not taken (NotImplementedError).",
    "seqlen_k_per_split": "keys per split, a multiple of the kernel's tile_n: a sequence's "
                          "output then does not depend on the rest of the batch.",
    "disable_scheduler_metadata": "FA4's scheduling hint, accepted and not needed.",
    "gather_bwd_recompute_p": "gathered K/V's backward option: not built "
                              "(NotImplementedError).",
    "gather_bwd_token_chunk": "gathered K/V's backward option: not built "
                              "(NotImplementedError).",
    "arch": "a pipeline by name (\"ampere\", \"hopper\", \"blackwell\"), or None for "
            "dispatch's choice.",
    "block_mask": "a FlexAttention BlockMask (flash_cute.create_block_mask).",
    "alibi_slopes": "float32 [nheads] or [batch, nheads], flash-attn 2's ALiBi.",
    "dropout_p": "dropout of the attention weights in the kernels, kept ones scaled by "
                 "1 / (1 - p).",
    "q_descale": "FP8: float32 [batch, nheads_kv] (None: 1.0), or block scales.",
    "k_descale": "FP8: float32 [batch, nheads_kv], or block scales.",
    "v_descale": "FP8: float32 [batch, nheads_kv], or block scales.",
    "out_dtype": "FP8: the output's dtype, torch.bfloat16 (default) or torch.float16.",
    "rotary_cos": "[seqlen_ro, rotary_dim / 2]: rotary applied to q and the new k.",
    "rotary_sin": "as rotary_cos.",
    "rotary_interleaved": "rotary on interleaved pairs (GPT-J) rather than halves (GPT-NeoX).",
    "cache_seqlens": "int or int32 [batch]: rows already in each sequence's cache.",
    "cache_batch_idx": "int32 [batch]: the cache entry each sequence uses.",
    "cache_leftpad": "int32 [batch]: where each sequence's cache starts.",
    "return_softmax_lse": "return (out, lse) instead of out.",
}

RAISES = """Raises:
    TypeError: wrong dtypes (mixed, fp32, a non-int32 index tensor) or argument types.
    ValueError: shapes, devices or arguments that do not fit together, and, with
        `flash_cute.check_inputs(True)` or on the CPU, index contents out of range.
    NotImplementedError: a feature or head dim the chosen pipeline lacks, or one not built
        anywhere (qv, gathered K/V), naming it and the pipelines that have it."""


def document(fn, returns: str = "", raises: str = RAISES, **own) -> None:
    """Append the Args (in `fn`'s signature order; `own` overrides the shared descriptions),
    Returns (`returns`, when given) and Raises sections to `fn`'s docstring."""
    described = {**PARAMS, **own}
    names = [p for p in inspect.signature(fn).parameters if p in described]
    args = "\n".join(f"    {name}: {described[name]}" for name in names)
    returns = f"Returns:\n    {returns}\n\n" if returns else ""
    fn.__doc__ = (f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:\n{args}\n\n{returns}"
                  f"{raises}")
