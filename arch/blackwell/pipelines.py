"""The blackwell forward's pipeline as data (`flash_cute.contract.pipeline`): tcgen05 MMAs
issued by one warp into tensor memory, two softmax warpgroups and a correction warpgroup.
Compile-verified only."""

from flash_cute.contract.pipeline import Buffer, Pipeline, Role

from .config import ROLE_REGISTERS

RULE = ("warp specialization by warpgroup, setmaxnreg per warpgroup; TMEM lanes bind a warp "
        "to its quarter of the rows, so the row roles come in aligned groups of four warps")


def forward(kernel) -> Pipeline:
    """`BlackwellFwd`: two 128-row Q tiles per CTA, S, P and O in tensor memory."""
    soft0, soft1, correction, rest = ROLE_REGISTERS
    roles = (Role("softmax 0", (0, 1, 2, 3), "rows 0..127: S from TMEM, mask, row max, exp2 "
                  "(part in software), P to TMEM", soft0, 0),
             Role("softmax 1", (4, 5, 6, 7), "rows 128..255: the same", soft1, 1),
             Role("correction", (8, 9, 10, 11), "rescales O in TMEM, then O / l and LSE out",
                  correction, 2),
             Role("MMA", (12,), "issues every tcgen05 MMA; allocates and frees TMEM", rest, 3),
             Role("load", (13,), "TMA of Q0, Q1, then K[n], V[n]", rest, 3),
             Role("idle", (14, 15), "the MMA and load warps' warpgroup mates", rest, 3))
    ring = "TMA; mbarrier ring: bytes full / tcgen05.commit empty"
    buffers = (Buffer("Q", "SMEM", 2, "load", "MMA", ring),
               Buffer("K", "SMEM", kernel.k_stages, "load", "MMA", ring),
               Buffer("V", "SMEM", kernel.v_stages, "load", "MMA", ring),
               Buffer("S", "TMEM", 2, "MMA", "softmax 0", "s_full: tcgen05.commit"),
               Buffer("P", "TMEM", 2, "softmax 0", "MMA", "p_ready: softmax + correction"),
               Buffer("O", "TMEM", 2, "MMA", "correction", "o_full: tcgen05.commit"),
               Buffer("LSE", "SMEM", 2, "softmax 0", "correction", "stats pipeline"),
               Buffer("LSE", "RMEM", 1, "correction", "global", "row stores"))
    return Pipeline("blackwell.fwd", "sm_100a", roles, buffers, RULE,
                    ("compile-verified only",))
