"""The table of kernel configurations that `inspect` cross-compiles: the shared blocks' own
kernels, listed here, and each pipeline's, listed with that pipeline
(`arch/<name>/inspect_configs.py`). Tooling: the runtime never imports it.
"""

import importlib

from flash_cute.runtime.dispatch import PIPELINES
from flash_cute.tools.kernel_config import KernelConfig, config_flags

TARGETS = ("sm_80", "sm_90a", "sm_100a")


def build_softmax_rows(entry):
    """``blocks.softmax_rows`` with fake [b, sq, sk] scores."""
    from cutlass import Float32, Int32

    from flash_cute.runtime.jit import DTYPES, dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.block_kernels import ScoreAttentionKernel
    from flash_cute.tools.kernel_config import CompileSpec

    flags = entry.flag_dict
    dtype = DTYPES[entry.dtype]
    batch, seqlen_q, seqlen_k = dynamic_dim(), dynamic_dim(), dynamic_dim(divisibility=4)
    kernel = ScoreAttentionKernel(
        dtype, entry.hdim_v, causal=flags["causal"], has_window_left=flags["local"],
        has_window_right=flags["local"], has_softcap=flags["softcap"],
    )
    args = (
        fake_tensor(Float32, (batch, seqlen_q, seqlen_k)),
        fake_tensor(dtype, (batch, seqlen_k, entry.hdim_v)),
        fake_tensor(dtype, (batch, seqlen_q, entry.hdim_v)),
        fake_tensor(Float32, (batch, seqlen_q), align=4),
        Float32(0.125), Float32(1.0), Int32(0), Int32(0), fake_stream(),
    )
    return CompileSpec(kernel, args)


def build_lse_merge(entry):
    """``blocks.lse_merge`` with fake inputs in its layout (`lse_merge.LAYOUTS`)."""
    from cutlass import Float32

    from flash_cute.kernels.lse_merge import LseMergeKernel
    from flash_cute.runtime.jit import DTYPES, dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.kernel_config import CompileSpec

    layout = entry.flag_dict.get("layout", "rows")
    splits, d = dynamic_dim(), entry.hdim
    if layout == "rows":
        rows = dynamic_dim()
        shapes = ((rows, d), (rows,))
    elif layout == "padded":
        b, sq, h = dynamic_dim(), dynamic_dim(), dynamic_dim()
        shapes = ((b, sq, h, d), (b, h, sq))
    else:
        tq, h = dynamic_dim(), dynamic_dim()
        shapes = ((tq, h, d), (h, tq))
    args = (
        fake_tensor(Float32, (splits,) + shapes[0]),
        fake_tensor(Float32, (splits,) + shapes[1], align=4),
        fake_tensor(DTYPES[entry.dtype], shapes[0]),
        fake_tensor(Float32, shapes[1], align=4),
        fake_stream(),
    )
    return CompileSpec(LseMergeKernel(DTYPES[entry.dtype], entry.hdim, layout), args)


def build_bwd_prep(entry):
    """``blocks.bwd.preprocess`` and ``blocks.bwd.postprocess``."""
    from cutlass import Float32, Int32

    from flash_cute.kernels.bwd_prep import BwdPostprocessKernel, BwdPreprocessKernel
    from flash_cute.runtime.jit import DTYPES, dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.kernel_config import CompileSpec

    dtype = DTYPES[entry.dtype]
    flags = entry.flag_dict
    heads = dynamic_dim()
    if flags["varlen"]:
        total_q = dynamic_dim()
        q_rows, row_vec = (total_q, heads), (heads, total_q)
    else:
        batch, seqlen_q = dynamic_dim(), dynamic_dim()
        q_rows, row_vec = (batch, seqlen_q, heads), (batch, heads, seqlen_q)
    if entry.kernel == "blocks.bwd.postprocess":
        kernel = BwdPostprocessKernel(dtype, entry.hdim, flags["varlen"])
        shape = q_rows + (entry.hdim,)
        return CompileSpec(kernel, (fake_tensor(Float32, shape), fake_tensor(dtype, shape),
                                    Float32(0.125), fake_stream()))
    kernel = BwdPreprocessKernel(dtype, entry.hdim_v, flags["varlen"], flags["dlse"],
                                 flags.get("seqused_q", False), flags.get("zero_fill", False))
    o = tuple(fake_tensor(dtype, q_rows + (entry.hdim_v,)) for _ in range(2))
    vecs = [fake_tensor(Float32, row_vec, align=4) for _ in range(4)]
    dlse = vecs[1] if kernel.has_dlse else None
    cu, used = (fake_tensor(Int32, (dynamic_dim(),), align=4) if on else None
                for on in (kernel.varlen, kernel.has_seqused))
    zero = fake_tensor(Float32, (dynamic_dim(),), align=16) if kernel.zero_fill else None
    args = o + (vecs[0], dlse, vecs[2], vecs[3], cu, used, Int32(1), zero, fake_stream())
    return CompileSpec(kernel, args)


def build_exp2_emulated(entry):
    """``blocks.exp2_emulated`` over fake float32 vectors."""
    from cutlass import Float32

    from flash_cute.runtime.jit import dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.block_kernels import Exp2EmulatedKernel
    from flash_cute.tools.kernel_config import CompileSpec

    n = dynamic_dim()
    return CompileSpec(Exp2EmulatedKernel(entry.schedule[0]),
                       (fake_tensor(Float32, (n,), align=4), fake_tensor(Float32, (n,), align=4),
                        fake_stream()))


def build_graph_mods(entry):
    """``blocks.graph_mods`` of a documented mod (`variants.examples`) over fake [b, h, q, k]
    float32 scores."""
    from cutlass import Float32

    from flash_cute.contract.kernel_args import AUX_FIELDS
    from flash_cute.runtime.jit import dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.block_kernels import GraphModsKernel
    from flash_cute.tools.fake_args import fake_aux
    from flash_cute.tools.kernel_config import CompileSpec, example_spec

    spec = example_spec(entry.flag_dict["mods"])
    aux = fake_aux(spec)

    def scores():
        return fake_tensor(Float32, tuple(dynamic_dim() for _ in range(4)), align=4)

    return CompileSpec(GraphModsKernel(spec), (scores(), scores(), scores(),
                                               *(aux[f] for f in AUX_FIELDS), fake_stream()))


_BLOCKS = (
    KernelConfig("blocks.softmax_rows", TARGETS, "bf16", None, 16, (64, 64), build_softmax_rows,
                 config_flags(causal=False, local=False, softcap=False)),
    KernelConfig("blocks.softmax_rows", TARGETS, "bf16", None, 16, (64, 64), build_softmax_rows,
                 config_flags(causal=True, local=False, softcap=True)),
    KernelConfig("blocks.softmax_rows", TARGETS, "fp16", None, 16, (64, 64), build_softmax_rows,
                 config_flags(causal=False, local=True, softcap=False)),
    KernelConfig("blocks.lse_merge", TARGETS, "bf16", 128, 128, (4, 128), build_lse_merge),
    KernelConfig("blocks.lse_merge", TARGETS, "bf16", 128, 128, (4, 128), build_lse_merge,
                 (("layout", "padded"),)),
    KernelConfig("blocks.lse_merge", TARGETS, "fp16", 64, 64, (4, 64), build_lse_merge,
                 (("layout", "varlen"),)),
    KernelConfig("blocks.exp2_emulated", TARGETS, "fp32", None, None, (3,),
                 build_exp2_emulated),
    KernelConfig("blocks.graph_mods", TARGETS, "fp32", None, None, (64, 64), build_graph_mods,
                 (("mods", "alibi_document"),)),
    KernelConfig("blocks.graph_mods", TARGETS, "fp32", None, None, (64, 64), build_graph_mods,
                 (("mods", "softcap"),)),
)
_BWD_PREP = (
    KernelConfig("blocks.bwd.preprocess", TARGETS, "bf16", None, 128, (64, 128), build_bwd_prep,
                 config_flags(dlse=False, varlen=False, seqused_q=False, zero_fill=True)),
    KernelConfig("blocks.bwd.preprocess", TARGETS, "fp16", None, 64, (128, 64), build_bwd_prep,
                 config_flags(dlse=True, varlen=True, seqused_q=False)),
    KernelConfig("blocks.bwd.preprocess", TARGETS, "bf16", None, 128, (64, 128), build_bwd_prep,
                 config_flags(dlse=False, varlen=True, seqused_q=True)),
    KernelConfig("blocks.bwd.postprocess", TARGETS, "bf16", 128, None, (32, 128),
                 build_bwd_prep, config_flags(varlen=False)),
)

def _arch_configs(pipeline) -> tuple:
    """A pipeline's registered configs: `arch/<name>/inspect_configs.py`, by convention."""
    return importlib.import_module(f"flash_cute.arch.{pipeline.name}.inspect_configs").CONFIGS


CONFIGS = _BLOCKS + tuple(c for p in reversed(PIPELINES) for c in _arch_configs(p)) + _BWD_PREP


def registered_configs(kernel=None, target=None) -> list:
    """Configs whose kernel name matches `kernel` (exact, or a prefix ending in '.') and that
    compile for `target`."""
    out = []
    for entry in CONFIGS:
        if kernel and not (entry.kernel == kernel
                           or entry.kernel.startswith(kernel.rstrip(".") + ".")):
            continue
        if target and target not in entry.targets:
            continue
        out.append(entry)
    return out
