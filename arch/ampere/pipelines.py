"""The ampere kernels' pipelines as data (`flash_cute.contract.pipeline`): no warp
specialization, no setmaxnreg; every warp loads (cp.async), multiplies (mma.sync) and
exponentiates its own rows."""

from flash_cute.contract.pipeline import Buffer, Pipeline, Role

RULE = "all warps one role: no setmaxnreg, every warp keeps the launch register count"


def forward(kernel) -> Pipeline:
    """`AmpereFwd`: K/V double-buffered by cp.async, overlapping the previous block's math."""
    warps = tuple(range(kernel.num_warps))
    roles = (Role("all warps", warps, "cp.async of K/V, S = Q Kᵀ (mma.sync), mask, online "
                  "softmax, O += P V, epilogue"),)
    copy = "cp.async groups: wait_group + CTA barrier"
    buffers = (Buffer("Q", "SMEM", 1, "all warps", "all warps", copy),
               Buffer("K", "SMEM", 1, "all warps", "all warps", copy),
               Buffer("V", "SMEM", 1, "all warps", "all warps", copy),
               Buffer("S", "RMEM", 1, "all warps", "all warps", "-"),
               Buffer("P", "RMEM", 1, "all warps", "all warps", "S's accumulator as A operand"),
               Buffer("O", "RMEM", 1, "all warps", "all warps", "-"),
               Buffer("O", "SMEM", 1, "all warps", "global", "CTA barrier (through Q's tile)"),
               Buffer("LSE", "RMEM", 1, "all warps", "global", "row stores"))
    return Pipeline("ampere.fwd", "sm_80", roles, buffers, RULE)


def backward(kernel) -> Pipeline:
    """`AmpereBwd`: a K/V tile per CTA; dQ by fp32 atomics."""
    warps = tuple(range(kernel.num_warps))
    roles = (Role("all warps", warps, "cp.async of Q, dO; S, dP; P, dS to smem; dV, dK, dQ "
                  "(mma.sync); dQ by fp32 atomics"),)
    copy = "cp.async groups: wait_group + CTA barrier"
    buffers = (Buffer("K", "SMEM", 1, "all warps", "all warps", copy),
               Buffer("V", "SMEM", 1, "all warps", "all warps", copy),
               Buffer("Q", "SMEM", kernel.num_stages, "all warps", "all warps", copy),
               Buffer("dO", "SMEM", kernel.num_stages, "all warps", "all warps", copy),
               Buffer("S", "RMEM", 1, "all warps", "all warps", "-"),
               Buffer("P", "SMEM", 1, "all warps", "all warps", "CTA barrier"),
               Buffer("dS", "SMEM", 1, "all warps", "all warps", "CTA barrier"),
               Buffer("dK", "RMEM", 1, "all warps", "global", "-"),
               Buffer("dV", "RMEM", 1, "all warps", "global", "-"),
               Buffer("dQ", "GMEM", 1, "all warps", "global", "fp32 atomics"))
    return Pipeline("ampere.bwd", "sm_80", roles, buffers, RULE)
