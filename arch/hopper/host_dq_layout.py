"""The Hopper backward's fragment-order dQaccum, host side: its shape, and the launch that
turns it into dQ (`dq_accum.HopperDqPostprocess`, imported only to compile). The layout is
described in `dq_accum`."""

from typing import Optional

import torch

from flash_cute.contract.variant import dtype_name
from flash_cute.runtime.launch import KernelRef

_POSTPROCESS = KernelRef("flash_cute.arch.hopper.dq_accum", "HopperDqPostprocess")


def accum_shape(batch: int, seqlen_q: int, nheads: int, tile_m: int, hdim: int,
                total_q: Optional[int] = None) -> tuple:
    """dQaccum's shape: padded, or varlen when `total_q` is given (its batch is then the
    number of sequences)."""
    if total_q is not None:
        return (total_q // tile_m + batch, nheads, tile_m * hdim)
    return (batch, -(-seqlen_q // tile_m), nheads, tile_m * hdim)


class TiledDqAccum:
    """`launch_bwd.BackwardLaunch`'s dQaccum for the Hopper kernels with the shared dQ tile: the
    fragment-order tiles' shape, and their postprocess into dQ."""

    # Fragment-order tiles, each 16-byte aligned for the bulk reduce-add.
    align = 16

    def __init__(self, tile_m: int, split: tuple, swapped: bool = False):
        self.tile_m, self.split, self.swapped = tile_m, split, swapped

    @classmethod
    def of(cls, schedule: tuple, hdim: int) -> "TiledDqAccum":
        """The dQaccum of backward schedule `schedule`: its query rows, the dQ WGMMA's split
        over the consumer warpgroups and whether dQ is computed transposed."""
        from .config import BwdSchedule, bwd_mma_splits, dq_swapped

        schedule = BwdSchedule(*schedule)
        return cls(schedule.tile_m, bwd_mma_splits(schedule, hdim)["dq"], dq_swapped(schedule))

    def shape(self, q, problem) -> tuple:
        if problem.varlen:
            return accum_shape(problem.batch, 0, problem.nheads, self.tile_m, problem.hdim,
                               total_q=q.shape[0])
        return accum_shape(q.shape[0], q.shape[1], problem.nheads, self.tile_m, problem.hdim)

    def finisher(self, dq_accum, q, problem, cu_seqlens_q, target: str, out_dtype=None):
        """`finish(dq_accum, cu_seqlens_q) -> dq` (shaped like q; varlen rows outside every
        sequence: 0) for this configuration; `out_dtype` float32: dQ unrounded."""
        from flash_cute.runtime.jit import DTYPES, CompileKey, KernelCall, TensorArg, tensor_arg

        name, hdim, varlen = dtype_name(q.dtype), problem.hdim, problem.varlen
        alloc = torch.zeros if varlen else torch.empty
        wide = out_dtype == torch.float32
        shape, dtype, device = tuple(q.shape), torch.float32 if wide else q.dtype, q.device
        if q.numel() == 0:
            return lambda acc, cu: alloc(shape, dtype=dtype, device=device)
        key = CompileKey("hopper.bwd.dq_postprocess", target, name, hdim, None,
                         (self.tile_m, *self.split),
                         (("varlen", varlen), ("swapped", self.swapped))
                         + ((("fp32_out", True),) if wide else ()))
        scale, max_seqlen_q = float(problem.softmax_scale), int(problem.max_seqlen_q)
        call = KernelCall(key, lambda: _POSTPROCESS(DTYPES[name], hdim, self.tile_m, self.split,
                                                    varlen, self.swapped,
                                                    DTYPES["fp32"] if wide else None),
                          (TensorArg(dq_accum), TensorArg(q.new_empty((0,) * q.dim(), dtype=dtype)
                                                          if wide else q), scale,
                           tensor_arg(cu_seqlens_q, 4), max_seqlen_q))

        def finish(acc, cu):
            dq = alloc(shape, dtype=dtype, device=device)
            call(acc, dq, scale, cu, max_seqlen_q)
            return dq

        return finish
