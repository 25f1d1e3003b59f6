"""Host entry of the Ampere pipeline: what it supports, and the forward launch with its cache."""

import torch

from flash_cute.validation import AttentionProblem

from .config import COMPILE_OPTIONS, SUPPORTED_HDIMS, TILES
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_supported(problem: AttentionProblem) -> None:
    if (problem.hdim, problem.hdim_v) not in SUPPORTED_HDIMS:
        pairs = ", ".join(f"{a}/{b}" for a, b in sorted(SUPPORTED_HDIMS))
        raise NotImplementedError(
            f"the ampere pipeline has no kernel for hdim/hdim_v {problem.hdim}/{problem.hdim_v}; "
            f"supported: {pairs}"
        )


def _flags(problem: AttentionProblem) -> tuple:
    return (("causal", problem.causal), ("left", problem.window_left is not None),
            ("right", problem.window_right is not None and not problem.causal),
            ("softcap", problem.softcap > 0), ("varlen", problem.varlen))


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None):
    """(out, lse) for validated inputs; out has v's head dim, lse is fp32."""
    from cutlass import Float32, Int32
    import cutlass.cute as cute

    from flash_cute.jit import DTYPES, CompileKey, compile_cache, current_arch, current_stream, to_cute_tensor

    from .fwd import AmpereFwd

    out = torch.empty(*q.shape[:-1], problem.hdim_v, dtype=q.dtype, device=q.device)
    if problem.varlen:
        lse = torch.empty(problem.nheads, q.shape[0], dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(problem.batch, problem.nheads, q.shape[1], dtype=torch.float32,
                          device=q.device)
    if out.numel() == 0 or problem.max_seqlen_q == 0:
        lse.fill_(-float("inf"))
        return out.zero_(), lse
    flags = _flags(problem)
    dtype = _DTYPE_NAMES[q.dtype]
    key = CompileKey("ampere.fwd", current_arch(), dtype, problem.hdim, problem.hdim_v,
                     TILES[problem.hdim], flags)
    cu = (to_cute_tensor(cu_seqlens_q, 4), to_cute_tensor(cu_seqlens_k, 4)) if problem.varlen \
        else (None, None)
    args = (to_cute_tensor(q), to_cute_tensor(k), to_cute_tensor(v), to_cute_tensor(out),
            to_cute_tensor(lse, 4), Float32(problem.softmax_scale),
            Float32(problem.softcap if problem.softcap > 0 else 1.0),
            Int32(problem.window_left or 0), Int32(problem.window_right or 0),
            Int32(problem.max_seqlen_q)) + cu + (current_stream(),)

    def build():
        f = dict(flags)
        kernel = AmpereFwd(DTYPES[dtype], problem.hdim, problem.hdim_v, causal=f["causal"],
                           has_window_left=f["left"], has_window_right=f["right"],
                           has_softcap=f["softcap"], varlen=f["varlen"])
        return cute.compile(kernel, *args, options=COMPILE_OPTIONS)

    compile_cache.get(key, build)(*args)
    return out, lse
