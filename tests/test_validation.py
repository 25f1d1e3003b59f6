"""CPU tests for flash_cute.runtime.problem: every bad input gets a clear Python error."""

import math

import pytest
import torch

from flash_cute.runtime import contents
from flash_cute.runtime.problem import (
    AttentionProblem,
    validate_attention_inputs,
    validate_backward_inputs,
)

F16 = torch.float16


def qkv(b=2, sq=128, sk=128, h=4, hkv=4, d=64, dv=None, dtype=F16):
    dv = d if dv is None else dv
    return (
        torch.randn(b, sq, h, d, dtype=dtype),
        torch.randn(b, sk, hkv, d, dtype=dtype),
        torch.randn(b, sk, hkv, dv, dtype=dtype),
    )


def validate(q, k, v, **kw):
    """CPU tests skip only the CUDA-device checks."""
    kw.setdefault("require_cuda", False)
    return validate_attention_inputs(q, k, v, **kw)


def varlen_inputs(lens_q=(3, 5, 8), lens_k=(4, 4, 10), h=4, hkv=2, d=64):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, dtype=F16)
    k = torch.randn(sum(lens_k), hkv, d, dtype=F16)
    v = torch.randn(sum(lens_k), hkv, d, dtype=F16)
    meta = dict(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
    )
    return q, k, v, meta


def misaligned(shape, dtype=F16, device="cpu"):
    """A contiguous tensor whose data pointer is one element past a 16-byte boundary."""
    buf = torch.empty(math.prod(shape) + 1, dtype=dtype, device=device)
    return buf[1:].view(shape)


# --------------------------------------------------------------------------- devices


def test_cpu_tensors_rejected_when_cuda_required():
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor.*device 'cpu'"):
        validate_attention_inputs(*qkv())


def test_cpu_cu_seqlens_rejected_when_cuda_required():
    q, k, v, meta = varlen_inputs()
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        validate_attention_inputs(q, k, v, **meta)


# --------------------------------------------------------------------------- types and dtypes


def test_non_tensor_input():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        validate(q, [1, 2], v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"same dtype.*k.dtype=torch.bfloat16"):
        validate(q, k.bfloat16(), v)


def test_float32_rejected():
    with pytest.raises(TypeError, match=r"torch.float16', 'torch.bfloat16'\], got torch.float32"):
        validate(*qkv(dtype=torch.float32))


def test_custom_supported_dtypes():
    with pytest.raises(TypeError, match=r"\['torch.float16'\], got torch.bfloat16"):
        validate(*qkv(dtype=torch.bfloat16), supported_dtypes=(F16,))


# --------------------------------------------------------------------------- shapes


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seqlen, nheads, hdim\], got q.shape=\(2, 128, 256\)"):
        validate(q.flatten(2), k, v)


def test_batch_mismatch():
    q, _, _ = qkv(b=2)
    _, k, v = qkv(b=3)
    with pytest.raises(ValueError, match=r"same batch size.*q.shape=\(2, 128, 4, 64\), k.shape=\(3, 128, 4, 64\)"):
        validate(q, k, v)


def test_seqlen_k_mismatch_between_k_and_v():
    q, k, _ = qkv(sk=128)
    _, _, v = qkv(sk=96)
    with pytest.raises(ValueError, match=r"k and v must have the same seqlen_k.*v.shape=\(2, 96, 4, 64\)"):
        validate(q, k, v)


def test_nheads_kv_mismatch_between_k_and_v():
    q, k, _ = qkv(h=4, hkv=2)
    _, _, v = qkv(h=4, hkv=4)
    with pytest.raises(ValueError, match="k and v must have the same number of heads"):
        validate(q, k, v)


def test_hdim_mismatch_between_q_and_k():
    q, _, _ = qkv(d=64)
    _, k, v = qkv(d=128)
    with pytest.raises(ValueError, match="q and k must have the same head dim.*q hdim=64 and k hdim=128"):
        validate(q, k, v)


def test_nheads_not_multiple_of_nheads_kv():
    with pytest.raises(ValueError, match=r"nheads \(6, from q\) must be a multiple of nheads_kv \(4"):
        validate(*qkv(h=6, hkv=4))


def test_unsupported_head_dim_default_range():
    with pytest.raises(NotImplementedError, match=r"hdim=60 is not supported.*multiples of 8 in \[8, 256\]"):
        validate(*qkv(d=60))
    with pytest.raises(NotImplementedError, match="hdim=264"):
        validate(*qkv(d=264))


def test_unsupported_head_dim_pair():
    supported = {(64, 64), (128, 128), (192, 128)}
    assert validate(*qkv(d=192, dv=128), supported_hdims=supported).hdim_v == 128
    with pytest.raises(NotImplementedError, match=r"\(hdim=96, hdim_v=96\).*\(192, 128\)"):
        validate(*qkv(d=96), supported_hdims=supported)


# --------------------------------------------------------------------------- memory layout


def test_non_contiguous_last_dim():
    q, k, v = qkv()
    vt = torch.randn(2, 128, 64, 4, dtype=F16).transpose(-1, -2)  # [b, s, h, d] view, stride(-1) = 4
    with pytest.raises(ValueError, match=r"v must be contiguous in its last \(head\) dim.*v.stride\(\)=\(32768, 256, 1, 4\)"):
        validate(q, k, vt)
    validate(q, k, vt.contiguous())


def test_misaligned_pointer():
    q, k, v = qkv()
    k_bad = misaligned(tuple(k.shape))
    with pytest.raises(ValueError, match=r"k.data_ptr\(\) must be 16-byte aligned.*2 bytes past.*storage_offset=1"):
        validate(q, k_bad, v)


def test_stride_not_multiple_of_16_bytes():
    q, k, v = qkv()
    q_bad = torch.randn(2, 128, 4, 68, dtype=F16)[..., :64]  # head stride 68 elements
    with pytest.raises(ValueError, match=r"q.stride\(2\)=68 must be a multiple of 8 elements"):
        validate(q_bad, k, v)


def test_strided_views_that_keep_alignment_are_accepted():
    q, k, v = qkv()
    q_wide = torch.randn(2, 128, 4, 72, dtype=F16)[..., :64]  # head stride 72 = 9 * 8
    k_bcast = k[:1].expand(2, -1, -1, -1)  # broadcast batch, stride 0
    problem = validate(q_wide, k_bcast, v)
    assert problem.batch == 2


# --------------------------------------------------------------------------- scalars and masks


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number > 0.*0\.125"):
        validate(*qkv(), softmax_scale=scale)


def test_softmax_scale_wrong_type():
    with pytest.raises(TypeError, match="softmax_scale must be a real number, got str"):
        validate(*qkv(), softmax_scale="0.1")


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap(cap):
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        validate(*qkv(), softcap=cap)


def test_causal_with_positive_right_window():
    with pytest.raises(ValueError, match=r"causal=True.*right window bound.*got window_size=\(128, 16\)"):
        validate(*qkv(), causal=True, window_size=(128, 16))


def test_bad_window_types():
    with pytest.raises(TypeError, match="window_size must be a \\(left, right\\) pair"):
        validate(*qkv(), window_size=(1, 2, 3))
    with pytest.raises(TypeError, match=r"window_size\[0\] \(left\) must be None or an int.*got float"):
        validate(*qkv(), window_size=(1.5, None))
    with pytest.raises(TypeError, match="causal must be a bool"):
        validate(*qkv(), causal="yes")


@pytest.mark.parametrize(
    "causal, window, expected",
    [
        (False, (None, None), (False, None, None, False)),
        (False, (-1, -1), (False, None, None, False)),
        (True, (None, None), (True, None, 0, False)),
        (True, (-1, 0), (True, None, 0, False)),
        (True, (256, -1), (True, 256, 0, True)),
        (False, (None, 0), (True, None, 0, False)),  # (None, 0) is plain causal
        (False, (64, 32), (False, 64, 32, True)),
        (False, (-5, 32), (False, None, 32, True)),
    ],
)
def test_window_normalization(causal, window, expected):
    p = validate(*qkv(), causal=causal, window_size=window)
    assert (p.causal, p.window_left, p.window_right, p.is_local) == expected


# --------------------------------------------------------------------------- valid round trip


def test_valid_gqa_problem_round_trip():
    q, k, v = qkv(b=3, sq=100, sk=300, h=8, hkv=2, d=128, dtype=torch.bfloat16)
    p = validate(q, k, v, softcap=30.0)
    assert p == AttentionProblem(
        batch=3, seqlen_q=100, seqlen_k=300, max_seqlen_q=100, max_seqlen_k=300,
        nheads=8, nheads_kv=2, hdim=128, hdim_v=128, dtype=torch.bfloat16, varlen=False,
        softmax_scale=1 / math.sqrt(128), causal=False, window_left=None, window_right=None,
        softcap=30.0,
    )
    assert p.qheads_per_kvhead == 4 and p.has_softcap and not p.is_local
    assert validate(q, k, v, softmax_scale=0.5).softmax_scale == 0.5


def test_padded_max_seqlen_must_match():
    assert validate(*qkv(sq=64), max_seqlen_q=64).max_seqlen_q == 64
    with pytest.raises(ValueError, match="max_seqlen_q=32 does not match the padded sequence length 64"):
        validate(*qkv(sq=64), max_seqlen_q=32)


def test_padded_seqused():
    q, k, v = qkv(b=2, sk=128)
    validate(q, k, v, seqused_k=torch.tensor([100, 128], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_k must have shape \[2\] \(batch\), got seqused_k.shape=\(3,\)"):
        validate(q, k, v, seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_k\[1\]=129 must be in \[0, 128\]"):
        validate(q, k, v, seqused_k=torch.tensor([100, 129], dtype=torch.int32))


# --------------------------------------------------------------------------- varlen


def test_valid_varlen_round_trip():
    q, k, v, meta = varlen_inputs()
    p = validate(q, k, v, causal=True, **meta)
    assert (p.varlen, p.batch, p.seqlen_q, p.seqlen_k) == (True, 3, None, None)
    assert (p.max_seqlen_q, p.max_seqlen_k, p.nheads, p.nheads_kv) == (8, 10, 4, 2)
    assert (p.causal, p.window_right, p.qheads_per_kvhead) == (True, 0, 2)


def test_varlen_cu_seqlens_wrong_dtype():
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_q"] = meta["cu_seqlens_q"].long()
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 tensor, got dtype torch.int64"):
        validate(q, k, v, **meta)


def test_varlen_cu_seqlens_wrong_shape():
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_k"] = meta["cu_seqlens_k"].view(2, 2)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape 1-D \[batch \+ 1\], got cu_seqlens_k.shape=\(2, 2\)"):
        validate(q, k, v, **meta)


def test_varlen_cu_seqlens_length_mismatch():
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_k"] = meta["cu_seqlens_k"][:3]
    with pytest.raises(ValueError, match=r"cu_seqlens_q.shape=\(4,\) \(batch 3\) and cu_seqlens_k.shape=\(3,\) \(batch 2\)"):
        validate(q, k, v, **meta)


def test_varlen_requires_both_cu_seqlens():
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_k"] = None
    with pytest.raises(NotImplementedError, match="cu_seqlens_q was given without cu_seqlens_k"):
        validate(q, k, v, **meta)


def test_varlen_missing_max_seqlen():
    q, k, v, meta = varlen_inputs()
    del meta["max_seqlen_k"]
    with pytest.raises(ValueError, match="max_seqlen_k is required for varlen inputs"):
        validate(q, k, v, **meta)


def test_varlen_wrong_rank():
    q, k, v, meta = varlen_inputs()
    with pytest.raises(ValueError, match=r"q must be 3-D \[total, nheads, hdim\] \(varlen"):
        validate(q.unsqueeze(0), k, v, **meta)


def test_varlen_non_monotonic_cu_seqlens():
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_q"] = torch.tensor([0, 3, 2, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"non-decreasing.*cu_seqlens_q\[2\]=2 < cu_seqlens_q\[1\]=3"):
        validate(q, k, v, **meta)


def test_varlen_cu_seqlens_past_total():
    q, k, v, meta = varlen_inputs()  # total_k = 18
    meta["cu_seqlens_k"] = torch.tensor([0, 4, 8, 19], dtype=torch.int32)
    meta["max_seqlen_k"] = 11
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=19 exceeds the 18 tokens"):
        validate(q, k, v, **meta)


def test_varlen_max_seqlen_too_small():
    q, k, v, meta = varlen_inputs()
    meta["max_seqlen_q"] = 7
    with pytest.raises(ValueError, match=r"max_seqlen_q=7 is smaller than the longest sequence \(length 8, batch index 2\)"):
        validate(q, k, v, **meta)


def test_varlen_seqused_exceeds_sequence():
    q, k, v, meta = varlen_inputs()  # k lengths (4, 4, 10)
    with pytest.raises(ValueError, match=r"seqused_k\[0\]=5 must be in \[0, 4\]"):
        validate(q, k, v, seqused_k=torch.tensor([5, 4, 10], dtype=torch.int32), **meta)


def test_seqused_sets_the_problem_flags():
    q, k, v, meta = varlen_inputs()
    p = validate(q, k, v, seqused_q=torch.tensor([3, 0, 8], dtype=torch.int32), **meta)
    assert (p.has_seqused_q, p.has_seqused_k) == (True, False)
    p = validate(*qkv(b=2), seqused_k=torch.tensor([1, 2], dtype=torch.int32))
    assert (p.has_seqused_q, p.has_seqused_k, p.varlen) == (False, True, False)
    p = validate(q, k, v, **meta)
    assert (p.has_seqused_q, p.has_seqused_k) == (False, False)


def test_seqused_type_shape_and_layout():
    q, k, v, meta = varlen_inputs()
    with pytest.raises(TypeError, match="seqused_q must be an int32 tensor, got dtype torch.int64"):
        validate(q, k, v, seqused_q=torch.tensor([1, 2, 3]), **meta)
    with pytest.raises(TypeError, match="seqused_k must be a torch.Tensor, got list"):
        validate(q, k, v, seqused_k=[1, 2, 3], **meta)
    with pytest.raises(ValueError, match=r"seqused_q must have shape \[3\] \(batch\)"):
        validate(q, k, v, seqused_q=torch.tensor([[1, 2, 3]], dtype=torch.int32), **meta)
    strided = torch.tensor([1, 9, 2, 9, 3, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="seqused_k must be contiguous"):
        validate(q, k, v, seqused_k=strided, **meta)


def test_seqused_values_are_checked_when_readable():
    q, k, v, meta = varlen_inputs()  # q lengths (3, 5, 8)
    with pytest.raises(ValueError, match=r"seqused_q\[2\]=9 must be in \[0, 8\]"):
        validate(q, k, v, seqused_q=torch.tensor([3, 5, 9], dtype=torch.int32), **meta)
    with pytest.raises(ValueError, match=r"seqused_q\[0\]=-1 must be in \[0, 3\]"):
        validate(q, k, v, seqused_q=torch.tensor([-1, 5, 8], dtype=torch.int32), **meta)


def test_max_seqlen_needs_to_cover_only_the_used_lengths():
    """max_seqlen sizes the grid over the lengths the kernels use: with seqused a span may be
    longer (e.g. a KV cache's capacity), but a used length may not."""
    q, k, v, meta = varlen_inputs()  # k lengths (4, 4, 10)
    meta["max_seqlen_k"] = 6
    p = validate(q, k, v, seqused_k=torch.tensor([4, 2, 6], dtype=torch.int32), **meta)
    assert p.max_seqlen_k == 6
    with pytest.raises(ValueError, match=r"max_seqlen_k=6 is smaller than the longest sequence "
                                         r"\(length 7, batch index 2\) in seqused_k="):
        validate(q, k, v, seqused_k=torch.tensor([4, 2, 7], dtype=torch.int32), **meta)
    with pytest.raises(ValueError, match=r"max_seqlen_k=6 is smaller than the longest sequence "
                                         r"\(length 10, batch index 2\) in cu_seqlens_k="):
        validate(q, k, v, **meta)


def test_varlen_q_with_padded_kv_cache_is_refused():
    """flash-attn also takes packed q with a padded k/v (seqused_k); flash-cute does not yet."""
    q, _, _, meta = varlen_inputs()
    _, k, v = qkv(b=3, sk=16, hkv=2)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q was given without cu_seqlens_k.*"
                                                  "or neither with padded q, k, v"):
        validate(q, k, v, cu_seqlens_q=meta["cu_seqlens_q"], max_seqlen_q=8,
                 seqused_k=torch.tensor([3, 16, 0], dtype=torch.int32))


# --------------------------------------------------------------------------- backward


def bwd_inputs(b=2, sq=33, sk=64, h=4, hkv=2, d=64):
    q, k, v = qkv(b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d)
    problem = validate(q, k, v)
    out = torch.randn_like(q)
    lse = torch.randn(b, h, sq)  # odd seqlen: head stride 33 floats must still be fine
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse, problem=problem)


def test_backward_valid():
    validate_backward_inputs(**bwd_inputs(), require_cuda=False)
    q, k, v, meta = varlen_inputs()
    problem = validate(q, k, v, **meta)
    out = torch.randn_like(q)
    lse = torch.randn(problem.nheads, q.shape[0])
    validate_backward_inputs(out.clone(), q, k, v, out, lse, problem, require_cuda=False)


def test_backward_requires_cuda():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        validate_backward_inputs(**bwd_inputs())


def test_backward_dout_mismatch():
    args = bwd_inputs()
    with pytest.raises(ValueError, match=r"dout must have the same shape as out.*dout.shape=\(2, 32, 4, 64\)"):
        validate_backward_inputs(**{**args, "dout": args["dout"][:, :32]}, require_cuda=False)
    with pytest.raises(TypeError, match="dout must have the same dtype as out.*torch.bfloat16"):
        validate_backward_inputs(**{**args, "dout": args["dout"].bfloat16()}, require_cuda=False)


def test_backward_lse_checks():
    args = bwd_inputs()
    with pytest.raises(TypeError, match="lse must be float32.*torch.float16"):
        validate_backward_inputs(**{**args, "lse": args["lse"].half()}, require_cuda=False)
    with pytest.raises(ValueError, match=r"lse must have shape \[batch, nheads, seqlen_q\] = \(2, 4, 33\), got lse.shape=\(2, 33, 4\)"):
        validate_backward_inputs(**{**args, "lse": args["lse"].transpose(1, 2).contiguous()}, require_cuda=False)
    with pytest.raises(ValueError, match=r"lse must be contiguous in its last dim"):
        lse_t = torch.randn(2, 33, 4).transpose(1, 2)
        validate_backward_inputs(**{**args, "lse": lse_t}, require_cuda=False)


def test_backward_out_and_qkv_must_match_problem():
    args = bwd_inputs()
    with pytest.raises(ValueError, match=r"out.shape=\(2, 33, 4, 32\) does not match the padded forward problem: expected \(2, 33, 4, 64\)"):
        validate_backward_inputs(**{**args, "out": args["out"][..., :32]}, require_cuda=False)
    with pytest.raises(ValueError, match=r"k.shape=\(2, 32, 2, 64\) does not match"):
        validate_backward_inputs(**{**args, "k": args["k"][:, :32]}, require_cuda=False)


def test_backward_misaligned_dout():
    args = bwd_inputs()
    dout = misaligned(tuple(args["out"].shape))
    with pytest.raises(ValueError, match=r"dout.data_ptr\(\) must be 16-byte aligned"):
        validate_backward_inputs(**{**args, "dout": dout}, require_cuda=False)


# --------------------------------------------------------------------------- content reads


def test_contents_not_read_off_cpu():
    """Non-CPU metadata is not read (that would sync a GPU) unless check_contents=True."""
    q, k, v, meta = varlen_inputs()
    meta["cu_seqlens_q"] = torch.tensor([0, 3, 2, 16], dtype=torch.int32, device="meta")
    p = validate(q.to("meta"), k.to("meta"), v.to("meta"), **meta)
    assert p.batch == 3


# --------------------------------------------------------------------------- CUDA only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_checks():
    q, k, v = (t.cuda() for t in qkv())
    assert validate_attention_inputs(q, k, v).batch == 2
    with pytest.raises(ValueError, match="v must be a CUDA tensor"):
        validate_attention_inputs(q, k, v.cpu())
    with pytest.raises(ValueError, match="16-byte aligned"):
        validate_attention_inputs(q, misaligned(tuple(k.shape), device="cuda"), v)


@pytest.mark.gpu
@needs_cuda
def test_cuda_seqused_device_and_contents():
    q, k, v = (t.cuda() for t in qkv(b=2, sk=128))
    with pytest.raises(ValueError, match="seqused_k must be a CUDA tensor"):
        validate_attention_inputs(q, k, v, seqused_k=torch.tensor([1, 2], dtype=torch.int32))
    past = torch.tensor([100, 129], dtype=torch.int32, device="cuda")
    assert validate_attention_inputs(q, k, v, seqused_k=past).has_seqused_k  # not read
    with pytest.raises(ValueError, match=r"seqused_k\[1\]=129 must be in \[0, 128\]"):
        validate_attention_inputs(q, k, v, seqused_k=past, check_contents=True)


@pytest.mark.gpu
@needs_cuda
def test_cuda_contents_checked_only_on_request():
    q, k, v, meta = varlen_inputs()
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    meta = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in meta.items()}
    meta["cu_seqlens_q"] = torch.tensor([0, 3, 2, 16], dtype=torch.int32, device="cuda")
    validate_attention_inputs(q, k, v, **meta)
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_attention_inputs(q, k, v, check_contents=True, **meta)


# --------------------------------------------------------------------------- the content check


def _packed(total=256, heads=2, d=64):
    return tuple(torch.randn(total, heads, d, dtype=torch.bfloat16) for _ in range(3))


@pytest.mark.parametrize("cu_q,used_k,max_q,match", [
    ([0, 128, 4096], None, 4096, r"cu_seqlens_q\[-1\]=4096 exceeds the 256 tokens"),
    ([0, 200, 100], None, 200, r"cu_seqlens_q must be non-decreasing.*cu_seqlens_q\[2\]=100"),
    ([0, 100, 256], None, 100, r"max_seqlen_q=100 is smaller than the longest sequence "
                               r"\(length 156, batch index 1\)"),
    ([0, 100, 256], [500, 3], 156, r"seqused_k\[0\]=500 must be in \[0, 100\]"),
    ([5, 100, 256], None, 156, r"cu_seqlens_q\[0\] must be 0"),
])
def test_the_content_check_names_the_tensor_and_the_entry(cu_q, used_k, max_q, match):
    """The four contents cases of issue 21 (and a nonzero start), each a clear error."""
    q, k, v = _packed()
    cu = torch.tensor(cu_q, dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 256], dtype=torch.int32)
    used = None if used_k is None else torch.tensor(used_k, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        contents.check_index_contents(q, k, cu, cu_k, None, used, max_q, 156)


def test_good_contents_pass_the_check():
    q, k, v = _packed()
    cu = torch.tensor([0, 100, 100, 256], dtype=torch.int32)  # an empty sequence
    used = torch.tensor([7, 0, 156], dtype=torch.int32)
    contents.check_index_contents(q, k, cu, cu, used, used, 156, 156)
    contents.check_index_contents(q, k)  # nothing to read


def test_check_inputs_checks_every_call_while_on(monkeypatch):
    """`flash_cute.check_inputs(True)` checks the contents of every call of the CUDA operator,
    planned or not (the plan cache keys shapes, not values); off, nothing is read
    (`plans.forward` called directly: CPU tensors stand in for CUDA ones)."""
    import flash_cute
    from flash_cute.runtime import plans

    seen = []
    monkeypatch.setattr(plans, "check_index_contents", lambda *a: seen.append(a[2].tolist()))
    plan = plans._Plan(validate(*_packed(), cu_seqlens_q=torch.tensor([0, 256], dtype=torch.int32),
                                cu_seqlens_k=torch.tensor([0, 256], dtype=torch.int32),
                                max_seqlen_q=256, max_seqlen_k=256),
                       None, None, False, lambda *t, rng_seed=None: (t[0], None))
    monkeypatch.setattr(plans, "_PLANS", type("P", (), {"get": staticmethod(lambda k: plan),
                                                        "put": staticmethod(lambda k, v: 0)})())
    monkeypatch.setattr(plans, "on_device", lambda t: __import__("contextlib").nullcontext())
    q, k, v = _packed()

    def call(cu):
        plans.forward(q, k, v, cu, cu, None, None, 256, 256, None, False, None, None, 0.0,
                      None, False, None, False, 0)

    previous = flash_cute.check_inputs(True)
    try:
        for end in (256, 300):
            call(torch.tensor([0, end], dtype=torch.int32))
        assert seen == [[0, 256], [0, 300]]
        assert flash_cute.check_inputs(False) is True
        call(torch.tensor([0, 300], dtype=torch.int32))
        assert len(seen) == 2
    finally:
        flash_cute.check_inputs(previous)
