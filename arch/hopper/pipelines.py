"""The hopper kernels' pipelines as data (`flash_cute.contract.pipeline`), from the values
each kernel instance compiles with; `HopperFwd.pipeline` / `HopperBwd.pipeline` return them."""

from flash_cute.contract.pipeline import Buffer, Pipeline, Role

_RULE = ("warp specialization: warpgroup 0 produces (setmaxnreg down), the consumer "
         "warpgroups compute (setmaxnreg up); setmaxnreg is warpgroup-wide")


def forward(kernel) -> Pipeline:
    """`HopperFwd`: one producer warp, 64 query rows per consumer warpgroup."""
    roles = [Role("producer", (0,), "TMA of Q per tile, then K[n], V[n] per block",
                  kernel.producer_registers, 0),
             Role("idle", (1, 2, 3), "the producer's warpgroup mates",
                  kernel.producer_registers, 0)]
    for wg in range(1, kernel.num_wg + 1):
        rows = f"rows {64 * (wg - 1)}..{64 * wg - 1}"
        roles.append(Role("consumer", tuple(range(4 * wg, 4 * wg + 4)),
                          f"{rows}: S = Q Kᵀ (WGMMA), mask, online softmax, O += P V, epilogue",
                          kernel.consumer_registers, wg))
    ring = "TMA; mbarrier ring: bytes full / consumer release empty"
    buffers = [Buffer("Q", "SMEM", 1, "producer", "consumer", ring),
               Buffer("K", "SMEM", kernel.kv_stages, "producer", "consumer", ring),
               Buffer("V", "SMEM", kernel.kv_stages, "producer", "consumer", ring),
               Buffer("S", "RMEM", 1, "consumer", "consumer", "WGMMA wait_group"),
               Buffer("P", "RMEM", 1, "consumer", "consumer", "registers: S's accumulator "
                      "becomes PV's A operand"),
               Buffer("O", "RMEM", 1, "consumer", "consumer", "WGMMA accumulator")]
    if kernel.o_tile != "none":
        buffers.append(Buffer("O", "SMEM", 1, "consumer", "global", "named barrier: O's tile "
                              "written, then TMA store"))
    buffers.append(Buffer("LSE", "RMEM", 1, "consumer", "global", "row stores"))
    return Pipeline("hopper.fwd", "sm_90a", tuple(roles), tuple(buffers), _RULE)


def backward(kernel, producer_registers: int, consumer_registers: int,
             consumer_warpgroups: int) -> Pipeline:
    """`HopperBwd`: a K/V tile per CTA, query tiles streamed through it."""
    roles = [Role("producer", (0,), "TMA of K, V once; Q, dO, LSE₂, Δ per query tile",
                  producer_registers, 0),
             Role("dQ writer", (1,), "bulk reduce-add of each dQ tile to global"
                  if kernel.dq_tma else "idle (dQ by fp32 atomics from the consumers)",
                  producer_registers, 0),
             Role("idle", (2, 3), "the producer's warpgroup mates", producer_registers, 0)]
    for wg in range(1, consumer_warpgroups + 1):
        roles.append(Role("consumer", tuple(range(4 * wg, 4 * wg + 4)),
                          "S, dP (WGMMA), P, dS, dV += Pᵀ dO, dK += dSᵀ Q, dQ = dS K",
                          consumer_registers, wg))
    ring = "TMA; mbarrier ring: bytes full / consumer release empty"
    buffers = [Buffer("K", "SMEM", 1, "producer", "consumer", ring),
               Buffer("V", "SMEM", 1, "producer", "consumer", ring),
               Buffer("Q", "SMEM", kernel.q_stages, "producer", "consumer", ring),
               Buffer("LSE", "SMEM", kernel.q_stages, "producer", "consumer", ring),
               Buffer("dO", "SMEM", kernel.do_stages, "producer", "consumer", ring),
               Buffer("S", "RMEM", 1, "consumer", "consumer", "WGMMA wait_group"),
               Buffer("P", "SMEM", kernel.pds_stages, "consumer", "consumer",
                      "named barrier, async-proxy fence (dV's operand)"),
               Buffer("dS", "SMEM", kernel.pds_stages, "consumer", "consumer",
                      "named barrier of both warpgroups (dQ, dK operands)"),
               Buffer("dK", "RMEM", 1, "consumer", "global", "accumulated over query tiles"),
               Buffer("dV", "RMEM", 1, "consumer", "global", "accumulated over query tiles")]
    if kernel.dq_tma:
        buffers += [Buffer("dQ", "SMEM", 1, "consumer", "dQ writer",
                           "named barriers: full (consumers) / empty (writer)"),
                    Buffer("dQ", "GMEM", 1, "dQ writer", "global", "fp32 bulk reduce-add")]
    else:
        buffers.append(Buffer("dQ", "GMEM", 1, "consumer", "global", "fp32 atomics"))
    return Pipeline("hopper.bwd", "sm_90a", tuple(roles), tuple(buffers), _RULE)


def forward_fp8(kernel) -> Pipeline:
    """`HopperFwdFp8`: `forward`'s roles and buffers, with producer warps 1..3 transposing V
    into a K-major Vᵀ ring that the consumers' FP8 PV reads."""
    base = forward(kernel)
    roles = [r if r.name != "idle" else
             Role("transpose", r.warps, "V[n] to Vᵀ[n] (32-bit words, PRMT), keys in PV's order",
                  kernel.producer_registers, 0) for r in base.roles]
    buffers = []
    for b in base.buffers:
        if b.tensor == "V" and b.memory == "SMEM":
            buffers += [Buffer("V", "SMEM", b.stages, "producer", "transpose", b.barrier),
                        Buffer("V", "SMEM", b.stages, "transpose", "consumer",
                                    "mbarrier ring: transpose threads full (after an "
                                    "async-proxy fence) / consumer threads empty")]
        elif b.tensor == "P":
            buffers.append(Buffer("P", "RMEM", 1, "consumer", "consumer",
                                       "registers: S's accumulator x 256 to e4m3, read as "
                                       "PV's A operand in a permuted key order"))
        else:
            buffers.append(b)
    return Pipeline("hopper.fwd_fp8", "sm_90a", tuple(roles), tuple(buffers), _RULE)
