"""The contract between dispatch and an arch pipeline: one `Pipeline` descriptor per arch.

Each `arch/<name>/descriptor.py` declares its `Descriptor` once, as data: the compute
capabilities it runs on, what it can do (`capabilities`), whether it ran on hardware. Its
planner (`arch/<name>/planner.py`) joins it to the entry points (`Pipeline.of`), and dispatch
(`flash_cute.runtime.dispatch`) reads only those: a new feature is a new capability name here
and in the pipelines that have it, not a global flag per module.

Plain Python (a contract): no torch, no CuTe DSL, nothing else of ours.
"""

from dataclasses import dataclass
from typing import Callable, Optional

# Capability names. A problem needs some (`required_capabilities`); a pipeline that lacks one
# is never picked for it, and refuses it by name when asked for with arch=.
FORWARD = "forward"
BACKWARD = "backward"
CAUSAL = "causal"
LOCAL = "local"  # a sliding window on either side
SOFTCAP = "softcap"
GQA = "gqa"
VARLEN = "varlen"  # packed sequences with cu_seqlens
SEQUSED = "seqused"  # per-sequence used lengths (seqused_q / seqused_k)
PACK_GQA = "pack_gqa"  # a K/V head's query heads in one tile's rows, on request
DETERMINISTIC = "deterministic"  # bitwise reproducible backward
DROPOUT = "dropout"  # dropout of the attention weights in the kernels (`flash_cute.blocks.dropout`)
# The forward writes a decode step's new K/V rows into the cache it reads (`kv_append`);
# without it they are written by torch operations first (`launch_fwd.AppendFirst`).
APPEND = "append"
# Traced score / mask mods in the score seam (`flash_cute.blocks.graph_mods`); a block mask's
# block sparsity (its skipped and full blocks) is a capability of its own.
MODS = "mods"
BLOCK_SPARSE = "block_sparse"
# The FP8 forward: e4m3 Q, K, V with descales or block scales (`flash_cute.fp8`).
FP8 = "fp8"

# What a message calls each one (the argument a user passed).
_SPELLED = {SEQUSED: "seqused_q/seqused_k", PACK_GQA: "pack_gqa=True",
            DETERMINISTIC: "deterministic=True", VARLEN: "cu_seqlens (varlen)",
            LOCAL: "window_size", SOFTCAP: "softcap", CAUSAL: "causal=True",
            GQA: "GQA/MQA (fewer K/V heads)", BACKWARD: "a backward pass",
            DROPOUT: "dropout_p > 0", MODS: "score_mod / mask_mod / alibi_slopes",
            BLOCK_SPARSE: "block_mask (block sparsity)",
            FP8: "float8_e4m3fn q, k and v (the FP8 forward)"}


def spelled(capability: str) -> str:
    return _SPELLED.get(capability, capability)


@dataclass(frozen=True)
class Descriptor:
    """What an arch pipeline is, as data (`arch/<name>/descriptor.py`): its name, the compute
    capability majors it runs on, its capability set, and whether it ran on hardware. Its
    planner (`arch/<name>/planner.py`, runtime) joins it to the entry points (`Pipeline.of`);
    its inspect configs are `arch/<name>/inspect_configs.py` (tools)."""

    name: str
    majors: range
    capabilities: frozenset
    hardware_tested: bool = True
    # What the support matrix (`flash_cute.tools.support_matrix`, the README's table) shows
    # beside the capabilities: the input dtypes, the (hdim, hdim_v) pairs of the forward,
    # the backward and the FP8 forward, the forward's decode paths, and `verified`: the card
    # and date of the last run of its GPU suite ("" while it has not run on hardware).
    dtypes: tuple = ("bf16", "fp16")
    head_dims: tuple = ()
    backward_head_dims: tuple = ()
    fp8_head_dims: tuple = ()
    decode: tuple = ()
    verified: str = ""

    def __post_init__(self):
        if self.hardware_tested != bool(self.verified):
            raise ValueError(f"pipeline {self.name}: hardware_tested and `verified` (where "
                             "and when it ran) go together")


@dataclass(frozen=True)
class Pipeline:
    """An arch pipeline as dispatch sees it: its descriptor's fields and its planner's entry
    points (`Pipeline.of`).

    `majors`: the compute capability majors it runs on. `plan_forward(q, k, v, problem,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)` and `plan_backward(dout, dlse, q, k, v,
    out, lse, problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, deterministic)` take
    validated inputs and return the launch of that call configuration, worked out once and
    kept by the plan cache: called with the same arguments (or any of the same dtypes,
    shapes, strides and alignment) it returns (out, lse), or (dq, dk, dv) without dlse, problem
    and deterministic; `forward` and `backward` do both at once.
    `check_supported(problem, device, backward)` raises
    NotImplementedError for what the capability names do not cover (head dims, shared memory).
    `takes(problem, backward)`: whether dispatch picks it on its own for a problem it can
    run, in the forward alone or with its backward too (None: always). `hardware_tested`: it
    ran on real hardware; a pipeline that has not (compile-verified only) stays out of the
    default order and runs only when named with arch=.
    Decode needs no entry point of its own: `plan_forward` takes `problem.num_splits`
    (`flash_cute.runtime.splits`), a `page_table` keyword (k / v paged, `flash_cute.runtime.paging`)
    and, with the `append` capability, an `append` keyword ((k_new, v_new) written into the cache).
    """

    name: str
    majors: range
    capabilities: frozenset
    plan_forward: Callable
    check_supported: Callable
    plan_backward: Optional[Callable] = None
    takes: Optional[Callable] = None
    hardware_tested: bool = True
    descriptor: Optional[Descriptor] = None

    @classmethod
    def of(cls, descriptor: Descriptor, **entry_points) -> "Pipeline":
        """The pipeline of `descriptor` with its planner's `entry_points` (plan_forward,
        check_supported, and plan_backward / takes where it has them)."""
        return cls(name=descriptor.name, majors=descriptor.majors,
                   capabilities=descriptor.capabilities,
                   hardware_tested=descriptor.hardware_tested, descriptor=descriptor,
                   **entry_points)

    def __post_init__(self):
        if (BACKWARD in self.capabilities) != (self.plan_backward is not None):
            raise ValueError(f"pipeline {self.name}: the {BACKWARD!r} capability and the "
                             "backward entry point go together")

    def forward(self, q, k, v, problem, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                seqused_k=None, rng_seed=None):
        lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        return self.plan_forward(q, k, v, problem, *lengths)(q, k, v, *lengths,
                                                             rng_seed=rng_seed)

    def backward(self, dout, dlse, q, k, v, out, lse, problem, cu_seqlens_q=None,
                 cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic=False,
                 rng_seed=None):
        lengths = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        return self.plan_backward(dout, dlse, q, k, v, out, lse, problem, *lengths,
                                  deterministic)(dout, dlse, q, k, v, out, lse, *lengths,
                                                 rng_seed=rng_seed)

    @property
    def has_backward(self) -> bool:
        return self.plan_backward is not None

    def runs_on(self, major: int) -> bool:
        return major in self.majors

    def missing(self, needed) -> Optional[str]:
        """The first capability of `needed` this pipeline lacks, spelled for a message."""
        for cap in needed:
            if cap not in self.capabilities:
                return spelled(cap)
        return None


def required_capabilities(problem, backward: bool = False, deterministic: bool = False) -> tuple:
    """The capabilities a validated `AttentionProblem` needs, in a fixed order (the first
    missing one is the one a message names)."""
    needed = [FORWARD]
    if str(problem.dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
        needed.append(FP8)
    if backward:
        needed.append(BACKWARD)
        if deterministic:
            needed.append(DETERMINISTIC)
    if problem.causal:
        needed.append(CAUSAL)
    if problem.is_local:
        needed.append(LOCAL)
    if problem.softcap > 0:
        needed.append(SOFTCAP)
    if problem.qheads_per_kvhead > 1:
        needed.append(GQA)
        if problem.pack_gqa:
            needed.append(PACK_GQA)
    if problem.varlen:
        needed.append(VARLEN)
    if problem.has_seqused_q or problem.has_seqused_k:
        needed.append(SEQUSED)
    if problem.dropout_p > 0:
        needed.append(DROPOUT)
    if getattr(problem, "mods", None) is not None:
        needed.append(MODS)
        if problem.mods.block_states is not None:
            needed.append(BLOCK_SPARSE)
    return tuple(needed)
