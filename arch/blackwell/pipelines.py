"""The blackwell forward's and backward's pipelines as data (`flash_cute.contract.pipeline`):
tcgen05 MMAs issued by one warp into tensor memory; the forward's two softmax warpgroups and
correction warpgroup, the backward's dQ reduce and two compute warpgroups. Compile-verified
only."""

from flash_cute.contract.pipeline import Buffer, Pipeline, Role

from .config import BWD_ROLE_REGISTERS, ROLE_REGISTERS, ROLE_REGISTERS_ONE_TILE

RULE = ("warp specialization by warpgroup, setmaxnreg per warpgroup; TMEM lanes bind a warp "
        "to its quarter of the rows, so the row roles come in aligned groups of four warps")


def forward(kernel) -> Pipeline:
    """`BlackwellFwd`: two 128-row Q tiles per CTA (one at hdim 256, its blocks' S in two
    buffers in turn), S, P and O in tensor memory."""
    two = kernel.q_tiles == 2
    soft0, soft1, correction, rest = ROLE_REGISTERS if two else ROLE_REGISTERS_ONE_TILE
    roles = (Role("softmax 0", (0, 1, 2, 3), "rows 0..127: S from TMEM, mask, row max, exp2 "
                  "(part in software), P to TMEM" + ("" if two else "; S0 and S1 in turn"),
                  soft0, 0),
             Role("softmax 1", (4, 5, 6, 7), "rows 128..255: the same", soft1, 1) if two
             else Role("idle", (4, 5, 6, 7), "one Q tile: no second softmax", soft1, 1),
             Role("correction", (8, 9, 10, 11), "rescales O in TMEM, then O / l and LSE out",
                  correction, 2),
             Role("MMA", (12,), "issues every tcgen05 MMA; allocates and frees TMEM", rest, 3),
             Role("load", (13,), "TMA of the Q tiles, then K[n], V[n]", rest, 3),
             Role("idle", (14, 15), "the MMA and load warps' warpgroup mates", rest, 3))
    ring = "TMA; mbarrier ring: bytes full / tcgen05.commit empty"
    o_sync = "o_full: tcgen05.commit" + ("" if two else " after every PV")
    buffers = (Buffer("Q", "SMEM", kernel.q_tiles, "load", "MMA", ring),
               Buffer("K", "SMEM", kernel.k_stages, "load", "MMA", ring),
               Buffer("V", "SMEM", kernel.v_stages, "load", "MMA", ring),
               Buffer("S", "TMEM", 2, "MMA", "softmax 0", "s_full: tcgen05.commit"),
               Buffer("P", "TMEM", 2, "softmax 0", "MMA", "p_ready: softmax + correction"),
               Buffer("O", "TMEM", kernel.q_tiles, "MMA", "correction", o_sync),
               Buffer("LSE", "SMEM", kernel.q_tiles, "softmax 0", "correction",
                      "stats pipeline"),
               Buffer("LSE", "RMEM", 1, "correction", "global", "row stores"))
    return Pipeline("blackwell.fwd", "sm_100a", roles, buffers, RULE,
                    ("compile-verified only",))


BWD_RULE = ("warp specialization by warpgroup, setmaxnreg per warpgroup; TMEM lanes bind a "
            "warp to its quarter of the keys; with the pair only the leader CTA's MMA warp "
            "issues, and the peer CTA's signals reach it by remote arrivals and its relay warp")


def backward(kernel) -> Pipeline:
    """`BlackwellBwd`: a K/V tile per cluster (one CTA, or the pair's cta_group::2 MMAs),
    Sᵀ, dPᵀ, dV, dK and dQ in tensor memory."""
    reduce, compute0, compute1, rest = BWD_ROLE_REGISTERS
    pair = kernel.cta_group == 2
    folded = kernel.folded
    to = "shared memory" if folded else "TMEM"
    cols = ("query columns 0..31 and 64..95 (a lane's half of its key's row)" if folded
            else "query columns 0..63")
    roles = (Role("dQ reduce", (0, 1, 2, 3), "dQ from TMEM, fp32 atomics into dQaccum "
                  "(deterministic: in the cluster's turn)", reduce, 0),
             Role("compute 0", (4, 5, 6, 7), f"{cols} of Sᵀ and dPᵀ: P and dS to {to}, dS "
                  "to shared memory (the pair: this CTA's or the peer's); dV, dK out",
                  compute0, 1),
             Role("compute 1", (8, 9, 10, 11), "query columns 32..63 and 96..127: the same"
                  if folded else "query columns 64..127: the same", compute1, 2),
             Role("MMA", (12,), "the leader: every tcgen05 MMA (cta_group::2 with the pair); "
                  "allocates and frees TMEM", rest, 3),
             Role("load", (13,), "TMA of K, V (and Kᵀ) once, Q and dO (and Qᵀ, dOᵀ) per "
                  "query tile", rest, 3),
             Role("relay", (14,), "the pair's CTA 1: its dS complete → the leader's MMA"
                  if pair else "idle (one CTA)", rest, 3),
             Role("tail", (15,), "varlen, seqused: each stage landed, its rows past the "
                  "sequence zeroed, then the leader's ready barrier", rest, 3) if kernel.tails
             else Role("idle", (15,), "the MMA and load warps' warpgroup mate", rest, 3))
    ring = "TMA; mbarrier ring: bytes full (the leader's) / tcgen05.commit empty (both CTAs)"
    if kernel.tails:
        ring += "; the MMA waits ready (each CTA's tail warp, rows past the sequence zeroed)"
    handshake = "raw mbarriers (`pair.PairSync`): commits to both CTAs, arrivals on the leader"
    buffers = [Buffer("K", "SMEM", 1, "load", "MMA", ring),
               Buffer("V", "SMEM", 1, "load", "MMA", ring),
               Buffer("Q", "SMEM", kernel.q_stages, "load", "MMA", ring),
               Buffer("dO", "SMEM", kernel.do_stages, "load", "MMA", ring),
               Buffer("LSE", "SMEM", 2, "compute 0", "compute 0", "named barrier per step"),
               Buffer("S", "TMEM", 1, "MMA", "compute 0 + compute 1", "S_FULL / S_READ; "
                      + handshake),
               Buffer("P", "SMEM" if folded else "TMEM", 1, "compute 0 + compute 1", "MMA",
                      "P_FULL"),
               Buffer("dS", "SMEM" if folded else "TMEM", 1, "compute 0 + compute 1", "MMA",
                      "DS_FULL"),
               Buffer("dS", "SMEM", 1, "compute 0 + compute 1", "MMA",
                      "SDS_FULL (+ the peer's bulk copy and PEER_SDS) / SDS_EMPTY"),
               Buffer("dQ", "TMEM", 1, "MMA", "dQ reduce", "DQ_FULL / DQ_READ"),
               Buffer("dQ", "GMEM", 1, "dQ reduce", "global", "fp32 atomics"),
               Buffer("dV", "TMEM", 1, "MMA", "compute 0 + compute 1", "DKV_FULL"),
               Buffer("dK", "TMEM", 1, "MMA", "compute 0 + compute 1", "DKV_FULL"),
               Buffer("dK", "RMEM", 1, "compute 0 + compute 1", "global", "row stores")]
    return Pipeline("blackwell.bwd", "sm_100a", roles, tuple(buffers), BWD_RULE,
                    ("compile-verified only",
                     f"cta_group {kernel.cta_group}, cluster {kernel.schedule.cluster}"))
