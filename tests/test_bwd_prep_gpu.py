"""The backward's helper kernels on the GPU against float64 PyTorch: preprocess (Delta, LSElog2)
for padded and varlen layouts, and postprocess (dQ = dQaccum · scale). Skipped without CUDA."""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

NAN = float("nan")


def _inputs(shape, dtype, seed, wide=False):
    """O and dO of `shape` ([.., h, dv]); `wide` makes them views into buffers twice as wide,
    so every outer stride differs from the compact one."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = shape[-1] * (2 if wide else 1)
    o, do = (torch.randn(*shape[:-1], width, device="cuda", generator=gen).to(dtype)
             for _ in range(2))
    return o[..., :shape[-1]], do[..., :shape[-1]]


def _row_vector(shape, seed, neg_inf_every=0):
    """An fp32 per-row vector like the LSE; every `neg_inf_every`-th row set to -inf."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v = torch.randn(*shape, device="cuda", generator=gen) * 10
    if neg_inf_every:
        v[..., ::neg_inf_every] = -math.inf
    return v


def _reference(out, dout, lse, dlse):
    """float64 Delta, a per-row bound on fp32 summation error, and float64 LSE·log2 e (+inf for
    rows with LSE = -inf). Rows run along the last dim, like the LSE."""
    prod = dout.double() * out.double()
    delta = prod.sum(-1).movedim(-1, -2)
    bound = 1e-5 * prod.abs().sum(-1).movedim(-1, -2) + 1e-6
    if dlse is not None:
        delta = delta - dlse.double()
        bound = bound + 1e-6 * dlse.double().abs()
    lse_log2 = lse.double() * math.log2(math.e)
    lse_log2[torch.isneginf(lse)] = math.inf
    return delta, bound, lse_log2


def _check(delta, lse_log2, ref_delta, bound, ref_lse_log2):
    assert not delta.isnan().any() and not lse_log2.isnan().any(), "a row was left unwritten"
    err = (delta.double() - ref_delta).abs()
    assert (err <= bound).all(), f"Delta: max err {err.max().item():.3e}"
    assert torch.equal(torch.isposinf(lse_log2), torch.isposinf(ref_lse_log2)), \
        "rows with LSE = -inf must have LSElog2 = +inf, and only those"
    finite = torch.isfinite(ref_lse_log2)
    err = (lse_log2.double() - ref_lse_log2)[finite].abs()
    assert (err <= 1e-6 * ref_lse_log2[finite].abs()).all(), "LSElog2: more than fp32 rounding"


def _poisoned_like(lse):
    return torch.full_like(lse, NAN), torch.full_like(lse, NAN)


PADDED = [
    # (batch, seqlen_q, heads, hdim_v, dtype, has_dlse, wide)
    (2, 1, 3, 128, torch.bfloat16, False, False),
    (2, 77, 4, 64, torch.float16, True, False),
    (1, 300, 2, 128, torch.bfloat16, True, True),
    (3, 129, 1, 96, torch.bfloat16, False, False),
    (2, 33, 2, 192, torch.bfloat16, True, False),
    (1, 50, 2, 256, torch.float16, False, True),
    (1, 1030, 1, 8, torch.bfloat16, True, False),
]


@pytest.mark.parametrize("batch,seqlen,heads,hdim_v,dtype,has_dlse,wide", PADDED)
def test_preprocess_padded_matches_float64(batch, seqlen, heads, hdim_v, dtype, has_dlse, wide):
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    out, dout = _inputs((batch, seqlen, heads, hdim_v), dtype, seqlen * hdim_v, wide)
    lse = _row_vector((batch, heads, seqlen), seqlen + 1, neg_inf_every=7)
    if wide:  # a per-row vector whose row stride is not the compact one
        lse = torch.cat([lse, lse[..., :3]], dim=-1)[..., :seqlen]
    dlse = _row_vector((batch, heads, seqlen), seqlen + 2) if has_dlse else None
    delta, lse_log2 = _poisoned_like(lse)
    bwd_preprocess(out, dout, lse, dlse, delta=delta, lse_log2=lse_log2)
    _check(delta, lse_log2, *_reference(out, dout, lse, dlse))


VARLEN = [
    # (sequence lengths, padding rows after the last sequence, heads, hdim_v, dtype, has_dlse)
    ([5, 0, 131, 1, 64], 7, 3, 64, torch.float16, True),
    ([0, 200, 17, 0, 63], 0, 2, 128, torch.bfloat16, False),
]


@pytest.mark.parametrize("lengths,tail,heads,hdim_v,dtype,has_dlse", VARLEN)
@pytest.mark.parametrize("pass_max_seqlen", [True, False])
def test_preprocess_varlen_matches_float64(lengths, tail, heads, hdim_v, dtype, has_dlse,
                                           pass_max_seqlen):
    """Zero-length and odd-length sequences; rows after the last sequence stay untouched."""
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    used = int(cu[-1])
    out, dout = _inputs((used + tail, heads, hdim_v), dtype, used)
    lse = _row_vector((heads, used + tail), used + 1, neg_inf_every=5)
    dlse = _row_vector((heads, used + tail), used + 2) if has_dlse else None
    delta, lse_log2 = _poisoned_like(lse)
    bwd_preprocess(out, dout, lse, dlse, cu, max(lengths) if pass_max_seqlen else None,
                   delta=delta, lse_log2=lse_log2)
    assert delta[:, used:].isnan().all() and lse_log2[:, used:].isnan().all(), \
        "rows outside every sequence must not be written"
    ref = _reference(out[:used], dout[:used], lse[:, :used],
                     None if dlse is None else dlse[:, :used])
    _check(delta[:, :used], lse_log2[:, :used], *ref)


@pytest.mark.parametrize("varlen", [False, True])
def test_preprocess_seqused_reads_and_writes_only_the_used_rows(varlen):
    """Rows past seqused_q[b] (NaN in O and dO here) are neither read nor written."""
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    spans, used_q, heads, hdim_v = [77, 77, 77], [40, 0, 77], 2, 64
    rows = torch.cat([torch.arange(s, device="cuda") < u for s, u in zip(spans, used_q)])
    if varlen:
        out, dout = _inputs((sum(spans), heads, hdim_v), torch.bfloat16, 3)
        lse = _row_vector((heads, sum(spans)), 4, neg_inf_every=5)
        cu = torch.tensor([0] + spans, device="cuda").cumsum(0).to(torch.int32)
    else:
        out, dout = _inputs((3, spans[0], heads, hdim_v), torch.bfloat16, 3)
        lse = _row_vector((3, heads, spans[0]), 4, neg_inf_every=5)
        cu, rows = None, rows.view(3, spans[0])
    out[~rows], dout[~rows] = NAN, NAN
    delta, lse_log2 = _poisoned_like(lse)
    seqused = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    bwd_preprocess(out, dout, lse, None, cu, max(used_q), delta=delta, lse_log2=lse_log2,
                   seqused_q=seqused)
    by_row = (lambda t: t.transpose(0, 1)) if varlen else (lambda t: t.transpose(1, 2))
    assert by_row(delta)[~rows].isnan().all() and by_row(lse_log2)[~rows].isnan().all()
    # The used rows, as one sequence: [1, h, rows] like a padded LSE.
    used = lambda t: by_row(t)[rows].T.unsqueeze(0)  # noqa: E731
    ref = _reference(out[rows].unsqueeze(0), dout[rows].unsqueeze(0), used(lse), None)
    _check(used(delta), used(lse_log2), *ref)


def test_preprocess_empty_inputs_launch_nothing():
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    out = torch.empty(2, 0, 3, 64, device="cuda", dtype=torch.bfloat16)
    delta, lse_log2 = bwd_preprocess(out, out, torch.empty(2, 3, 0, device="cuda"))
    assert delta.shape == lse_log2.shape == (2, 3, 0)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    out = torch.empty(0, 3, 64, device="cuda", dtype=torch.bfloat16)
    delta, _ = bwd_preprocess(out, out, torch.empty(3, 0, device="cuda"), cu_seqlens_q=cu)
    assert delta.shape == (3, 0)


@pytest.mark.parametrize("shape,zero_numel,varlen", [
    ((2, 301, 3, 64), 2 * 301 * 3 * 64, False),
    # Far more pieces than threads in the grid, and fewer: each CTA's share, and empty ones.
    ((1, 17, 1, 128), 1_000_004, False), ((1, 700, 4, 64), 12, False),
    ((700, 4, 64), 700 * 4 * 64, True)])
def test_preprocess_zeroes_the_dq_accumulator(shape, zero_numel, varlen):
    """`zero`: the preprocess sets a NaN-poisoned fp32 buffer (the main kernel's dQaccum) to
    exactly 0, every element, and still writes Delta and LSElog2."""
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    out, dout = _inputs(shape, torch.bfloat16, 7)
    if varlen:
        cu = torch.tensor([0, 250, 251, 700], dtype=torch.int32, device="cuda")
        lse = _row_vector((shape[1], shape[0]), 8)
        kw = dict(cu_seqlens_q=cu, max_seqlen_q=449)
    else:
        lse = _row_vector((shape[0], shape[2], shape[1]), 8)
        kw = {}
    zero = torch.full((zero_numel,), NAN, device="cuda")
    delta, lse_log2 = bwd_preprocess(out, dout, lse, zero=zero, **kw)
    assert torch.count_nonzero(zero) == 0 and not zero.isnan().any()
    if not varlen:
        _check(delta, lse_log2, *_reference(out, dout, lse, None))


def test_preprocess_rejects_a_zero_buffer_it_cannot_store_to():
    from flash_cute.runtime.bwd_prep import bwd_preprocess

    out, dout = _inputs((1, 8, 1, 64), torch.bfloat16, 9)
    lse = _row_vector((1, 1, 8), 9)
    for bad in (torch.zeros(6, device="cuda"), torch.zeros(9, device="cuda")[1:],
                torch.zeros(8, 2, device="cuda").t(), torch.zeros(8, device="cuda").half()):
        with pytest.raises(ValueError, match="zero"):
            bwd_preprocess(out, dout, lse, zero=bad)


def test_preprocess_compiles_once_for_new_lengths():
    from flash_cute.runtime.bwd_prep import bwd_preprocess
    from flash_cute.runtime.jit import compile_cache

    def run(batch, seqlen):
        out, dout = _inputs((batch, seqlen, 2, 64), torch.bfloat16, seqlen)
        lse = _row_vector((batch, 2, seqlen), seqlen)
        delta, _ = bwd_preprocess(out, dout, lse)
        assert torch.allclose(delta.double(), _reference(out, dout, lse, None)[0], atol=1e-3)

    run(2, 40)
    compiled = len(compile_cache)
    for batch, seqlen in ((2, 41), (1, 300), (3, 1)):
        run(batch, seqlen)
    assert len(compile_cache) == compiled


POSTPROCESS = [
    # (q-like shape of dQaccum, dtype, wide)
    ((2, 77, 3, 128), torch.bfloat16, False),
    ((1, 1, 1, 64), torch.float16, False),
    ((3, 131, 2, 96), torch.bfloat16, True),
    ((250, 4, 128), torch.float16, False),
    ((1, 33, 2, 256), torch.bfloat16, False),
    ((37, 2, 64), torch.bfloat16, True),
]


@pytest.mark.parametrize("shape,dtype,wide", POSTPROCESS)
def test_postprocess_matches_torch(shape, dtype, wide):
    """fp32 product then one rounding to dtype: bit-exact against PyTorch doing the same."""
    from flash_cute.runtime.bwd_prep import bwd_postprocess

    gen = torch.Generator(device="cuda").manual_seed(shape[-1] * shape[0])
    width = shape[-1] * (2 if wide else 1)
    dq_accum = (torch.randn(*shape[:-1], width, device="cuda", generator=gen) * 30)[..., :shape[-1]]
    scale = 1.0 / math.sqrt(shape[-1])
    dq = torch.full(shape, NAN, device="cuda", dtype=dtype)
    bwd_postprocess(dq_accum, scale, dtype, out=dq)
    assert torch.equal(dq, (dq_accum * scale).to(dtype))
    # And within half a unit in the last place of the float64 value (8 significant bits for
    # bf16, 11 for fp16, whose subnormals are spaced 2^-24 apart).
    ref = dq_accum.double() * scale
    half_ulp = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    assert ((dq.double() - ref).abs() <= ref.abs() * half_ulp * 1.01 + 2.0 ** -25).all()
