"""LSE merge: combine attention results computed over disjoint key ranges.

For parts k with outputs O_k and log-sum-exps LSE_k over disjoint key sets:
``LSE = ln(sum_k exp(LSE_k))`` and ``O = sum_k exp(LSE_k - LSE) O_k``. Split-KV decode
and ring attention both rest on it. `merge_lse_row` is the per-row block; the kernel
merges a [splits, rows, d] stack. Model: `flash_cute.models.lse_merge`.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.softmax import LN_2, LOG2_E


@cute.jit
def merge_lse_row(mLSE_parts: cute.Tensor, num_splits: Int32, row: Int32):
    """(LSE, max) of one row over the splits; all -inf gives (-inf, 0)."""
    lse_max = -Float32.inf
    for s in cutlass.range(num_splits, unroll=1):
        lse_max = cute.arch.fmax(lse_max, mLSE_parts[s, row])
    lse_max_safe = Float32(0.0) if lse_max == -Float32.inf else lse_max
    total = Float32(0.0)
    for s in cutlass.range(num_splits, unroll=1):
        total = total + cute.math.exp2((mLSE_parts[s, row] - lse_max_safe) * Float32(LOG2_E), fastmath=True)
    lse = -Float32.inf
    if total > Float32(0.0):
        lse = lse_max_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)
    return lse


class LseMergeKernel:
    """Merges split results: O [rows, d] and LSE [rows] from [splits, rows, d] and [splits, rows].

    | warps | role                                                                       |
    |-------|----------------------------------------------------------------------------|
    | 0-3   | one row per warp at a time: LSE over the splits, then d/32 columns a lane   |

    No shared memory: the LSE of a row is read by the whole warp (one broadcast load per split).
    """

    num_threads = 128
    rows_per_cta = 4

    def __init__(self, out_dtype, hdim: int):
        if hdim % 32 != 0:
            raise ValueError(f"LSE merge needs hdim % 32 == 0, got {hdim}")
        self.out_dtype = out_dtype
        self.hdim = hdim
        self.vec = hdim // 32

    @cute.jit
    def __call__(
        self,
        mO_parts: cute.Tensor,
        mLSE_parts: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mO_parts [splits, rows, d] fp32, mLSE_parts [splits, rows] fp32 -> mO [rows, d], mLSE [rows]."""
        grid = (cute.ceil_div(mO.shape[0], self.rows_per_cta), 1, 1)
        self.kernel(mO_parts, mLSE_parts, mO, mLSE).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO_parts: cute.Tensor, mLSE_parts: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.rows_per_cta + tidx // 32
        num_splits = mO_parts.shape[0]
        if row < mO.shape[0]:
            lse = merge_lse_row(mLSE_parts, num_splits, row)
            lse_safe = Float32(0.0) if lse == -Float32.inf else lse
            acc = cute.make_rmem_tensor(self.vec, Float32)
            acc.fill(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                lse_s = mLSE_parts[s, row]
                weight = Float32(0.0)
                if lse_s > -Float32.inf:
                    weight = cute.math.exp2((lse_s - lse_safe) * Float32(LOG2_E), fastmath=True)
                part = cute.local_tile(mO_parts[s, row, None], (self.vec,), (lane,))
                acc.store(acc.load() + part.load() * weight)
            out = cute.local_tile(mO[row, None], (self.vec,), (lane,))
            out.store(acc.load().to(self.out_dtype))
            if lane == 0:
                mLSE[row] = lse


def lse_merge(o_parts, lse_parts, out_dtype=None, out=None, lse=None):
    """Merge on the GPU: o_parts [splits, rows, d] fp32, lse_parts [splits, rows] fp32.

    Returns (out [rows, d] in `out_dtype` (default bf16), lse [rows] fp32), written into
    `out`/`lse` when given.
    """
    import torch

    from flash_cute.jit import DTYPES, CompileKey, TensorArg, current_target, launch_kernel
    from flash_cute.variant import dtype_name

    out_dtype = out_dtype or torch.bfloat16
    _, rows, hdim = o_parts.shape
    if out is None:
        out = torch.empty(rows, hdim, dtype=out_dtype, device=o_parts.device)
    if lse is None:
        lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    dtype = dtype_name(out_dtype)
    key = CompileKey("blocks.lse_merge", current_target(), dtype, hdim, hdim,
                     (LseMergeKernel.rows_per_cta, hdim))
    args = (TensorArg(o_parts), TensorArg(lse_parts, 4), TensorArg(out), TensorArg(lse, 4))
    launch_kernel(key, lambda: LseMergeKernel(DTYPES[dtype], hdim), args)
    return out, lse
