"""The shared blocks alone on real hardware: test kernels and their launchers (tooling: the
GPU tests and `inspect` use them, no call of the library does).

`ScoreAttentionKernel`: attention over given scores.

``O = softmax(mask(softcap(S * scale))) V`` and its LSE, for a score matrix S that is an input
instead of Q Kᵀ. It runs the same online softmax, mask and block-range code as the attention
pipelines, on a register fragment laid out like an MMA accumulator (a quad of threads shares a
row), so the blocks' numerics are checked on every arch without any MMA in the way. `inspect`
registers it for sm_80, sm_90a and sm_100a as ``blocks.softmax_rows``.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.exp2_emu import exp2_emulated
from flash_cute.blocks.graph_mods import GraphMods
from flash_cute.blocks.mask import AttentionMask
from flash_cute.blocks.score import SOFTCAP, Scores, fold_scores
from flash_cute.blocks.softmax import OnlineSoftmax, rescale_o


class ScoreAttentionKernel:
    """One CTA per (64-row query tile, batch); 64-column score tiles, visited right to left.

    | warps | role                                                                 |
    |-------|----------------------------------------------------------------------|
    | 0-3   | all compute: a quad owns 2 rows (r, r+32), each thread 16 columns    |

    | stage | what                                                                 |
    |-------|----------------------------------------------------------------------|
    | load  | plain loads of a 64x64 S tile and the matching V rows (no pipeline)  |
    | mask  | only on tiles `block_range` marks as needing it                      |
    | P·V   | FFMA into a per-thread partial Õ, summed over the quad at the end    |
    """

    tile_m = 64
    tile_n = 64
    num_threads = 128
    threads_per_row = 4

    def __init__(
        self,
        dtype,
        hdim_v: int,
        causal: bool = False,
        has_window_left: bool = False,
        has_window_right: bool = False,
        has_softcap: bool = False,
    ):
        if hdim_v % self.threads_per_row != 0:
            raise ValueError(f"hdim_v must be a multiple of {self.threads_per_row}, got {hdim_v}")
        self.dtype = dtype
        self.hdim_v = hdim_v
        self.causal = causal
        self.has_window_left = has_window_left
        self.has_window_right = has_window_right and not causal
        self.score_mod = SOFTCAP if has_softcap else None

    @cute.jit
    def __call__(
        self,
        mS: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        """mS [b, sq, sk], mV [b, sk, dv], mO [b, sq, dv], mLSE [b, sq] (fp32)."""
        grid = (cute.ceil_div(mS.shape[1], self.tile_m), mS.shape[0], 1)
        self.kernel(mS, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, batch, _ = cute.arch.block_idx()
        seqlen_q = mS.shape[1]
        seqlen_k = mS.shape[2]
        win_left = window_left if cutlass.const_expr(self.has_window_left) else None
        win_right = window_right if cutlass.const_expr(self.has_window_right) else None

        scale_log2, mod_scale = fold_scores(self.score_mod, softmax_scale, softcap)

        thr_layout = cute.make_layout((32, self.threads_per_row), stride=(self.threads_per_row, 1))
        tile_coord = cute.make_identity_tensor((self.tile_m, self.tile_n))
        coord_mn = cute.local_partition(tile_coord, thr_layout, tidx)
        acc_s = cute.make_rmem_tensor(coord_mn.shape, Float32)
        acc_o = cute.make_rmem_tensor((cute.size(acc_s, mode=[0]), self.hdim_v), Float32)
        acc_o.fill(0.0)

        softmax = OnlineSoftmax(scale_log2, cute.size(acc_s, mode=[0]), self.threads_per_row)
        softmax.reset()
        mask = AttentionMask(
            self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal, win_left, win_right
        )
        scores = Scores(self.score_mod, mod_scale, mask)
        rng = mask.block_range(m_block)
        for n_block in cutlass.range(rng.n_block_max - 1, rng.n_block_min - 1, -1, unroll=1):
            self.load_scores(mS, acc_s, coord_mn, batch, m_block, n_block, seqlen_q, seqlen_k)
            scores.prepare(acc_s, coord_mn, m_block, n_block, rng)
            row_scale = softmax.online_softmax(acc_s)
            rescale_o(acc_o, row_scale)
            self.accumulate_pv(mV, acc_s, acc_o, coord_mn, batch, n_block, seqlen_k)

        o_scale, lse = softmax.finalize()
        rescale_o(acc_o, o_scale)
        self.store(mO, mLSE, acc_o, lse, coord_mn, batch, m_block, seqlen_q, tidx)

    @cute.jit
    def load_scores(self, mS, acc_s, coord_mn, batch, m_block, n_block, seqlen_q, seqlen_k):
        """Clamped loads: out-of-range entries read a valid element and are masked later."""
        for r in cutlass.range_constexpr(cute.size(acc_s, mode=[0])):
            row = cutlass.min(m_block * self.tile_m + coord_mn[r, 0][0], seqlen_q - 1)
            for c in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
                col = cutlass.min(n_block * self.tile_n + coord_mn[0, c][1], seqlen_k - 1)
                acc_s[r, c] = Float32(mS[batch, row, col])

    @cute.jit
    def accumulate_pv(self, mV, acc_p, acc_o, coord_mn, batch, n_block, seqlen_k):
        for c in cutlass.range_constexpr(cute.size(acc_p, mode=[1])):
            # P is exactly 0 past seqlen_k, so a clamped V row adds nothing.
            col = cutlass.min(n_block * self.tile_n + coord_mn[0, c][1], seqlen_k - 1)
            for d in cutlass.range_constexpr(self.hdim_v):
                v = Float32(mV[batch, col, d])
                for r in cutlass.range_constexpr(cute.size(acc_p, mode=[0])):
                    acc_o[r, d] = acc_o[r, d] + acc_p[r, c] * v

    @cute.jit
    def store(self, mO, mLSE, acc_o, lse, coord_mn, batch, m_block, seqlen_q, tidx):
        lane_in_row = tidx % self.threads_per_row
        for r in cutlass.range_constexpr(cute.size(acc_o, mode=[0])):
            row = m_block * self.tile_m + coord_mn[r, 0][0]
            for d in cutlass.range_constexpr(self.hdim_v):
                total = cute.arch.warp_reduction_sum(acc_o[r, d],
                                                     threads_in_group=self.threads_per_row)
                if row < seqlen_q and lane_in_row == d % self.threads_per_row:
                    mO[batch, row, d] = total.to(self.dtype)
            if row < seqlen_q and lane_in_row == 0:
                mLSE[batch, row] = lse[r]


def score_attention(scores, v, softmax_scale: float, causal: bool = False,
                    window_size=(None, None), softcap: float = 0.0, out=None, lse=None):
    """Run the kernel on CUDA tensors: scores [b, sq, sk] fp32, v [b, sk, dv] bf16/fp16.

    Returns (out [b, sq, dv] in v's dtype, lse [b, sq] fp32), written into `out`/`lse` when
    given. Window sides are None or >= 0.
    """
    import torch

    from flash_cute.contract.variant import dtype_name
    from flash_cute.runtime.jit import DTYPES, CompileKey, TensorArg, current_target, launch_kernel

    left, right = window_size
    batch, seqlen_q, _ = scores.shape
    if out is None:
        out = torch.empty(batch, seqlen_q, v.shape[2], dtype=v.dtype, device=v.device)
    if lse is None:
        lse = torch.empty(batch, seqlen_q, dtype=torch.float32, device=v.device)
    dtype = dtype_name(v.dtype)
    flags = (("causal", causal), ("left", left is not None), ("right", right is not None),
             ("softcap", softcap > 0))
    key = CompileKey("blocks.softmax_rows", current_target(), dtype, None, v.shape[2],
                     (ScoreAttentionKernel.tile_m, ScoreAttentionKernel.tile_n), flags)
    args = (TensorArg(scores, 4), TensorArg(v), TensorArg(out), TensorArg(lse, 4),
            float(softmax_scale), float(softcap if softcap > 0 else 1.0),
            int(left or 0), int(right or 0))
    launch_kernel(key, lambda: ScoreAttentionKernel(DTYPES[dtype], v.shape[2], causal,
                                                    left is not None, right is not None,
                                                    softcap > 0), args)
    return out, lse


# ---------------------------------------------------------------------------------------------
# `exp2_emu`: the software 2^x alone
# ---------------------------------------------------------------------------------------------

class Exp2EmulatedKernel:
    """`exp2_emulated` over a tensor, for measuring the block on hardware (`exp2_emulated_on_gpu`).

    | threads | role                                       |
    |---------|--------------------------------------------|
    | 0-255   | one value each: load, emulated 2^x, store  |

    No pipeline stages: one load and one store per thread.
    """

    num_threads = 256

    def __init__(self, degree: int = 3):
        self.degree = degree

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        grid = cute.ceil_div(mX.shape[0], self.num_threads)
        self.kernel(mX, mY).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1],
                                   stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        i = cute.arch.block_idx()[0] * self.num_threads + cute.arch.thread_idx()[0]
        if i < mX.shape[0]:
            mY[i] = exp2_emulated(mX[i], self.degree)


def exp2_emulated_on_gpu(x, degree: int = 3):
    """The block's 2^x of a CUDA float32 vector (< 2^31 values), as the kernels compute it."""
    import torch

    from flash_cute.runtime.jit import CompileKey, TensorArg, current_target, launch_kernel

    y = torch.empty_like(x)
    key = CompileKey("blocks.exp2_emulated", current_target(), "fp32", None, None, (degree,),
                     ())
    launch_kernel(key, lambda: Exp2EmulatedKernel(degree), (TensorArg(x, 4), TensorArg(y, 4)))
    return y


# ---------------------------------------------------------------------------------------------
# `graph_mods`: a traced mod alone, over a score tensor
# ---------------------------------------------------------------------------------------------

class GraphModsKernel:
    """`GraphMods` over a whole [b, h, q, k] score tensor, for checking the block on hardware
    against `tracer.evaluate` (`graph_mods_on_gpu`).

    | warps | role                                                                      |
    |-------|---------------------------------------------------------------------------|
    | 0-3   | one 64x64 tile of one (b, h): a quad of threads shares 2 rows, 16 columns |

    No pipeline stages: clamped loads of the tile, the mods, predicated stores of the result
    (-inf where masked) and of the derivative in the score.
    """

    tile = 64
    num_threads = 128

    def __init__(self, spec):
        self.spec = spec

    @cute.jit
    def __call__(self, mS: cute.Tensor, mOut: cute.Tensor, mGrad: cute.Tensor, aux0, aux1,
                 aux2, aux3, stream: cuda.CUstream):
        aux = tuple(a for a in (aux0, aux1, aux2, aux3) if a is not None)
        grid = (cute.ceil_div(mS.shape[2], self.tile), cute.ceil_div(mS.shape[3], self.tile),
                mS.shape[0] * mS.shape[1])
        self.kernel(mS, mOut, mGrad, aux).launch(grid=grid, block=[self.num_threads, 1, 1],
                                                 stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mOut: cute.Tensor, mGrad: cute.Tensor, aux):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, n_block, bh = cute.arch.block_idx()
        batch = bh // mS.shape[1]
        head = bh - batch * mS.shape[1]
        rows, cols = mS.shape[2], mS.shape[3]
        thr = cute.make_layout((32, 4), stride=(4, 1))
        coord = cute.local_partition(cute.make_identity_tensor((self.tile, self.tile)), thr,
                                     tidx)
        acc = cute.make_rmem_tensor(coord.shape, Float32)
        grad = cute.make_rmem_tensor(coord.shape, Float32)
        grad.fill(1.0)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            row = cutlass.min(m_block * self.tile + coord[r, 0][0], rows - 1)
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                col = cutlass.min(n_block * self.tile + coord[0, c][1], cols - 1)
                acc[r, c] = mS[batch, head, row, col]
        mods = GraphMods(self.spec, aux, batch, head, rows, cols, self.tile, self.tile)
        mods.apply(acc, coord, m_block, n_block, Float32(1.0), grad)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            row = m_block * self.tile + coord[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                col = n_block * self.tile + coord[0, c][1]
                if row < rows and col < cols:
                    mOut[batch, head, row, col] = acc[r, c]
                    mGrad[batch, head, row, col] = grad[r, c]


def graph_mods_on_gpu(variant, scores):
    """(mods' output, their derivative in the score) of a registered `registry.CallMods` on
    CUDA float32 scores [b, h, q, k], as the kernels compute them (q_idx and kv_idx are the
    positions in the tensor; a mask mod's False gives -inf; the derivative is 1 where the
    score mod has none, or is a bias)."""
    import torch

    from flash_cute.contract.kernel_args import AUX_ALIGN
    from flash_cute.runtime.jit import CompileKey, TensorArg, current_target, launch_kernel
    from flash_cute.variants.kernel_view import aux_for_kernel, kernel_mods

    spec, aux = kernel_mods(variant)
    out, grad = torch.empty_like(scores), torch.empty_like(scores)
    tensors = [aux_for_kernel(t) for t in aux]
    args = [TensorArg(scores, 4), TensorArg(out, 4), TensorArg(grad, 4)]
    args += [TensorArg(t, AUX_ALIGN[name]) for t, (name, _) in zip(tensors, spec.aux)]
    args += [None] * (7 - len(args))
    key = CompileKey("blocks.graph_mods", current_target(), "fp32", None, None, (),
                     (("mods", spec.key()),))
    launch_kernel(key, lambda: GraphModsKernel(spec), tuple(args))
    return out, grad
