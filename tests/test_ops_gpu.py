"""The torch.library operators on the GPU: opcheck of the CUDA kernels, mixed packed/padded
layouts against the float64 reference, torch.compile (inductor, fullgraph, dynamic) and CUDA
graph capture (issue 22)."""

import pytest
import torch
from attention_checks import AttentionBlock, check_forward

from flash_cute import flash_attn_func, flash_attn_varlen_func

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16


def _randn(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=BF16).requires_grad_(grad)


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def _options(causal=False, max_q=None, max_k=None):
    return (max_q, max_k, None, causal, None, None, 0.0, None, False, None)


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_of_the_cuda_kernels(varlen):
    if varlen:
        q, k, v = _randn(70, 4, 64, grad=True), _randn(90, 2, 64, grad=True), \
            _randn(90, 2, 64, grad=True)
        lengths = (_cu(0, 30, 70), _cu(0, 50, 90), None, None)
        opts = _options(True, 40, 50)
    else:
        q, k, v = _randn(2, 77, 4, 64, grad=True), _randn(2, 90, 2, 64, grad=True), \
            _randn(2, 90, 2, 64, grad=True)
        lengths, opts = (None,) * 4, _options(True)
    torch.library.opcheck(torch.ops.flash_cute.fwd.default, (q, k, v, *lengths, *opts, True, 0))
    out, lse = torch.ops.flash_cute.fwd(q.detach(), k.detach(), v.detach(), *lengths, *opts,
                                        False, 0)
    torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                          (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(), out,
                           lse, *lengths, *opts, 0))


def test_cuda_operators_equal_the_cpu_reference_operators():
    """The same operator on CUDA (kernels) and CPU (float32 reference) agree within the
    FlashAttention rule's bound, forward and backward."""
    q, k, v = _randn(2, 129, 4, 64, grad=True), _randn(2, 100, 2, 64, grad=True), \
        _randn(2, 100, 2, 64, grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, causal=True)
    qc, kc, vc = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    out_cpu, _ = flash_attn_func(qc, kc, vc, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_cpu = torch.autograd.grad(out_cpu, (qc, kc, vc), dout.cpu())
    for g, c in zip(grads, grads_cpu):
        assert (g.float().cpu() - c.float()).abs().max() <= 0.02 * c.float().abs().max() + 1e-3


@pytest.mark.parametrize("packed", ["q", "kv"])
def test_mixed_packed_and_padded_layouts(packed):
    """FA4's (unpad_q, unpad_kv) = (T, F) and (F, T) calls: one side packed, the other padded
    with seqused; every used row matches the reference of its sequence."""
    torch.manual_seed(0)
    b, s, h, hk, d = 3, 130, 4, 2, 128
    lens_q, lens_k = [17, 130, 0], [64, 1, 130]
    q_pad, k_pad, v_pad = _randn(b, s, h, d), _randn(b, s, hk, d), _randn(b, s, hk, d)
    if packed == "q":
        q_in = torch.cat([q_pad[i, :n] for i, n in enumerate(lens_q)])
        cu_q = _cu(0, *torch.tensor(lens_q).cumsum(0).tolist())
        out, lse = flash_attn_varlen_func(q_in, k_pad, v_pad, cu_seqlens_q=cu_q, max_seqlen_q=s,
                                          max_seqlen_k=s, seqused_k=_cu(*lens_k), causal=True,
                                          return_lse=True)
        rows = [out[sum(lens_q[:i]):sum(lens_q[:i + 1])] for i in range(b)]
        lses = [lse[:, sum(lens_q[:i]):sum(lens_q[:i + 1])] for i in range(b)]
    else:
        k_in = torch.cat([k_pad[i, :n] for i, n in enumerate(lens_k)])
        v_in = torch.cat([v_pad[i, :n] for i, n in enumerate(lens_k)])
        cu_k = _cu(0, *torch.tensor(lens_k).cumsum(0).tolist())
        out, lse = flash_attn_varlen_func(q_pad, k_in, v_in, cu_seqlens_k=cu_k, max_seqlen_q=s,
                                          max_seqlen_k=s, seqused_q=_cu(*lens_q), causal=True,
                                          return_lse=True)
        assert out.shape == (b, s, h, d) and lse.shape == (b, h, s)
        rows = [out[i, :n] for i, n in enumerate(lens_q)]
        lses = [lse[i, :, :n] for i, n in enumerate(lens_q)]
    for i in range(b):
        if lens_q[i] == 0:
            continue
        check_forward(rows[i][None], lses[i][None], q_pad[i:i + 1, :lens_q[i]],
                      k_pad[i:i + 1, :lens_k[i]], v_pad[i:i + 1, :lens_k[i]], causal=True)


def test_inductor_fullgraph_dynamic_training_step():
    """torch.compile (inductor) of a block's forward and backward: no graph break, one
    compile across sequence lengths, the eager result within bf16 noise."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(1)
    block = AttentionBlock(512, 8, 2, norm=torch.nn.RMSNorm, bias=False).cuda().to(BF16)
    explained = torch._dynamo.explain(block)(_randn(2, 100, 512))
    assert explained.graph_break_count == 0
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for t in (100, 257, 1000):
        x = _randn(2, t, 512, grad=True)
        y = compiled(x)
        (gx,) = torch.autograd.grad(y.float().square().mean(), x)
        xe = x.detach().requires_grad_()
        ye = block(xe)
        (gxe,) = torch.autograd.grad(ye.float().square().mean(), xe)
        assert (y - ye).abs().max() <= 0.05 * ye.abs().max()
        assert (gx - gxe).abs().max() <= 0.05 * gxe.abs().max()
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, f"recompiled at seqlen {t}"
    torch._dynamo.reset()


def test_cuda_graph_capture_and_replay():
    """A forward and backward captured in a CUDA graph replay to the eager result on new
    inputs copied into the captured buffers (the deterministic backward, so bit for bit)."""
    q, k, v = _randn(2, 300, 4, 128, grad=True), _randn(2, 300, 2, 128, grad=True), \
        _randn(2, 300, 2, 128, grad=True)
    dout = torch.randn(2, 300, 4, 128, device="cuda", dtype=BF16)

    def step():
        out, _ = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):   # plans and compiles outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for c, e in zip(captured, eager):
            assert torch.equal(c, e)
