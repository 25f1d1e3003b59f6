"""The blackwell pipeline's kernel configs for `inspect` (sm_100a, compile-verified only): the
forward's and the backward's."""

from flash_cute.tools.kernel_config import KernelConfig, config_flags

from .config import BWD_SCHEDULES, COMPILE_OPTIONS, FWD_SCHEDULES, default_ex2_per16

TARGETS = ("sm_100a",)


def build_fwd(entry):
    """Fake padded or varlen Q/K/V/O/LSE with dynamic batch, heads and lengths."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.kernel_config import forward_spec, variant_from_flags

    from .fwd import BlackwellFwd

    kernel = BlackwellFwd(DTYPES[entry.dtype], entry.hdim, entry.hdim_v,
                          variant_from_flags(entry.flag_dict), schedule=tuple(entry.schedule))
    return forward_spec(kernel, COMPILE_OPTIONS)


def _fwd_configs():
    out = []
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False}
    for (d, dv), flags in [((128, 128), {}), ((128, 128), {"causal": True}),
                           ((64, 64), {}), ((64, 64), {"causal": True, "fp16": True}),
                           ((192, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_k": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True}),
                           # Packed GQA: 4 and 8 query heads per K/V head in a Q tile.
                           ((128, 128), {"causal": True, "pack_gqa": 4}),
                           ((128, 128), {"varlen": True, "seqused_k": True, "pack_gqa": 8}),
                           # The exp2 share off, and doubled.
                           ((128, 128), {"causal": True, "ex2_emu": 0}),
                           ((128, 128), {"causal": True, "ex2_emu": 4}),
                           # Traced and FA4-form mods (`variants.examples`, `fa4_mod_examples`).
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           ((128, 128), {"mods": "document"}),
                           ((128, 128), {"varlen": True, "mods": "alibi_document"}),
                           ((128, 128), {"causal": True, "pack_gqa": 4,
                                         "mods": "relative_bias"}),
                           ((128, 128), {"mods": "fa4_softcap_causal"}),
                           # Block sparsity: the 256-row tile's span of non-empty tiles.
                           ((128, 128), {"causal": True, "mods": "document+blocks"}),
                           # hdim 256: one Q tile, S double-buffered (D-BW-HD256).
                           ((256, 256), {}), ((256, 256), {"causal": True}),
                           ((256, 256), {"causal": True, "varlen": True, "seqused_k": True}),
                           ((256, 256), {"local": True, "softcap": True, "fp16": True}),
                           ((256, 256), {"causal": True, "pack_gqa": 4}),
                           ((256, 256), {"varlen": True, "mods": "alibi_document"}),
                           ((256, 256), {"mods": "fa4_softcap_causal"}),
                           ((256, 256), {"causal": True, "mods": "document+blocks"})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        full = {**plain, **flags}
        share = full.pop("ex2_emu", None)
        full["ex2_emu"] = default_ex2_per16(d, full["causal"]) if share is None else share
        out.append(KernelConfig("blackwell.fwd", TARGETS, dtype, d, dv, FWD_SCHEDULES[(d, dv)],
                                build_fwd, config_flags(**full)))
    return tuple(out)


def _bwd_configs():
    out = []
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False}
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True, "fp16": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True}),
                           ((64, 64), {"causal": True, "deterministic": True}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_k": True}),
                           ((128, 128), {"causal": True, "deterministic": True}),
                           # GQA: fp32 dK and dV per query head, summed by the launch.
                           ((128, 128), {"causal": True, "dkv_fp32": True}),
                           ((192, 128), {}), ((192, 128), {"causal": True}),
                           ((192, 128), {"causal": True, "varlen": True, "seqused_q": True}),
                           ((192, 128), {"deterministic": True}),
                           # Traced and FA4-form mods, and a block mask.
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           ((128, 128), {"mods": "document"}),
                           ((128, 128), {"varlen": True, "mods": "alibi_document"}),
                           ((64, 64), {"mods": "fa4_softcap_causal"}),
                           ((128, 128), {"causal": True, "mods": "document+blocks"}),
                           # hdim 256: the pair at 64 keys a CTA, Pᵀ and dSᵀ through shared
                           # memory (D-BW-BWD-HD256).
                           ((256, 256), {}), ((256, 256), {"causal": True, "fp16": True}),
                           ((256, 256), {"causal": True, "varlen": True, "seqused_k": True}),
                           ((256, 256), {"local": True, "softcap": True}),
                           ((256, 256), {"causal": True, "deterministic": True}),
                           ((256, 256), {"causal": True, "dkv_fp32": True}),
                           ((256, 256), {"varlen": True, "mods": "alibi_document"}),
                           ((256, 256), {"mods": "fa4_softcap_causal"}),
                           ((256, 256), {"causal": True, "mods": "document+blocks"})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        out.append(KernelConfig("blackwell.bwd", TARGETS, dtype, d, dv, BWD_SCHEDULES[(d, dv)],
                                build_bwd, config_flags(**{**plain, **flags})))
    return tuple(out)



def build_bwd(entry):
    """Fake padded or varlen tensors with dynamic batch, heads and lengths; dQaccum like q, dK
    and dV in the input dtype (fp32 with `dkv_fp32`, as GQA's launch gives them)."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.fake_args import fake_backward_args
    from flash_cute.tools.kernel_config import CompileSpec, variant_from_flags

    from .bwd import BlackwellBwd

    dtype = DTYPES[entry.dtype]
    flags = entry.flag_dict
    kernel = BlackwellBwd(dtype, entry.hdim, entry.hdim_v, variant_from_flags(flags),
                          schedule=tuple(entry.schedule),
                          deterministic=flags.get("deterministic", False))
    args = fake_backward_args(dtype, entry.hdim, entry.hdim_v, kernel.varlen,
                              dkv_fp32=flags.get("dkv_fp32", False),
                              semaphores=kernel.deterministic,
                              seqused=(kernel.has_seqused_q, kernel.has_seqused_k),
                              mods=kernel.mods)
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes,
                       options=COMPILE_OPTIONS)


CONFIGS = _fwd_configs() + _bwd_configs()
