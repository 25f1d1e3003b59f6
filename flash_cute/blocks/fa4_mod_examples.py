"""FA4-form mods (`flash_cute.blocks.fa4_mods`), written as flash_attn.cute's tests write theirs:
`@cute.jit` functions on one-value TensorSSA vectors. Used by the registry (`inspect`) and the
GPU tests, and as templates for users porting FA4 code."""

import operator

import cutlass
import cutlass.cute as cute


@cute.jit
def rel_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """score − 0.01 · |q_idx − kv_idx| (its derivative is 1)."""
    diff = (q_idx - kv_idx).to(cutlass.Float32)
    dist = cute.where(operator.ge(diff, cute.full_like(diff, 0.0)), diff, -diff)
    return score - dist * cute.full_like(score, 0.01)


@cute.jit
def softcap30(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """30 · tanh(score / 30): a derivative that is not 1, from the dual numbers."""
    return cute.math.tanh(score * cute.full_like(score, 1.0 / 30.0)) * cute.full_like(score, 30.0)


@cute.jit
def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Top-left causal, as FA4's test mask mods write it."""
    return operator.ge(q_idx, kv_idx)


@cute.jit
def head_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """score + aux_tensors[0][h_idx]: a per-head bias read from a call's tensor."""
    bias = aux_tensors[0]
    value = cute.make_rmem_tensor(1, bias.element_type)
    value[0] = bias[h_idx[0]]
    return score + value.load().to(cutlass.Float32)


@cute.jit
def scaled_shift(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    """score · aux_scalars[0] + aux_scalars[1] (an Int32 and a Float32 run-time scalar, FA4's
    aux_scalars): the derivative aux_scalars[0], from the dual numbers."""
    scale = cute.full_like(score, cutlass.Float32(aux_scalars[0]))
    return score * scale + cute.full_like(score, cutlass.Float32(aux_scalars[1]))


@cute.jit
def alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """score − aux_tensors[0][h] · |q_idx − kv_idx| (slopes fp32 [nheads]), top-left
    aligned: `flash_cute.variants.examples.alibi` in FA4's form."""
    slopes = aux_tensors[0]
    slope = cute.make_rmem_tensor(1, cutlass.Float32)
    slope[0] = slopes[h_idx[0]]
    diff = (q_idx - kv_idx).to(cutlass.Float32)
    dist = cute.where(operator.ge(diff, cute.full_like(diff, 0.0)), diff, -diff)
    return score - dist * slope.load()


@cute.jit
def bias_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """The backward of any score mod that adds a bias (ALiBi): d/d(score) = 1."""
    return grad


@cute.jit
def document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """q and kv in the same document: aux_tensors[0] int32 [batch, seqlen] of document ids
    (`flash_cute.variants.examples.document_mask` in FA4's form, less its `kv_idx <= q_idx`, which
    a call adds with causal=True)."""
    ids = aux_tensors[0]
    doc_q = cute.make_rmem_tensor(1, cutlass.Int32)
    doc_q[0] = ids[b_idx[0], q_idx[0]]
    doc_kv = cute.make_rmem_tensor(1, cutlass.Int32)
    doc_kv[0] = ids[b_idx[0], kv_idx[0]]
    return operator.eq(doc_q.load(), doc_kv.load())


@cute.jit
def document_causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """`flash_cute.variants.examples.document_mask` in FA4's form, whole: same document and
    kv_idx <= q_idx (bench/variants.py's FA4 twin: `document` with FA4's causal=True and a
    block mask gave another output on sm90, docs/perf.md)."""
    same = document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)
    return same & (kv_idx <= q_idx)


def sliding_window(window: int):
    """Causal with the last `window` keys (`flash_cute.variants.examples.sliding_window` in FA4's
    form)."""
    @cute.jit
    def sliding_window_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return operator.ge(q_idx, kv_idx) & operator.lt(q_idx - kv_idx,
                                                         cute.full_like(q_idx, window))
    return sliding_window_mask


# name -> (score_mod, mask_mod, score_mod_bwd, aux (dtype name, rank) signature[, aux scalar
# types])
EXAMPLES = {
    "fa4_rel_bias": (rel_bias, None, None, ()),
    "fa4_softcap_causal": (softcap30, causal, None, ()),
    "fa4_head_bias": (head_bias, None, None, (("fp32", 1),)),
    "fa4_scaled_shift": (scaled_shift, None, None, (), ("Int32", "Float32")),
    "fa4_alibi_causal": (alibi, causal, bias_bwd, (("fp32", 1),)),
    "fa4_document": (None, document, None, (("i32", 2),)),
}
