"""The ampere pipeline's kernel configs for `inspect`, and how each is built for compiling."""

from flash_cute.tools.kernel_config import KernelConfig, config_flags

from .config import BWD_SCHEDULES, COMPILE_OPTIONS, FWD_SCHEDULES

TARGETS = ("sm_80",)
# sm100 runs the ampere pipeline until the blackwell one exists: one forward is also compiled
# for it, so `inspect` shows what runs there.
SM100_TOO = ("sm_80", "sm_100a")
# Every switch of an ampere config, off unless the entry turns it on.
_SWITCHES = {"causal": False, "local": False, "softcap": False, "varlen": False,
             "seqused_q": False, "seqused_k": False}


def build_fwd(entry):
    """Fake padded or varlen Q/K/V/O/LSE (and seqused) with dynamic batch and lengths."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.kernel_config import forward_spec, variant_from_flags

    from .fwd import AmpereFwd

    return forward_spec(AmpereFwd(DTYPES[entry.dtype], entry.hdim, entry.hdim_v,
                                  variant_from_flags(entry.flag_dict),
                                  schedule=tuple(entry.schedule)), COMPILE_OPTIONS)


def build_bwd(entry):
    """Fake padded or varlen tensors (and seqused) with dynamic batch, heads and lengths."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.fake_args import fake_backward_args
    from flash_cute.tools.kernel_config import CompileSpec, variant_from_flags

    from .bwd import AmpereBwd

    dtype = DTYPES[entry.dtype]
    kernel = AmpereBwd(dtype, entry.hdim, entry.hdim_v, variant_from_flags(entry.flag_dict))
    args = fake_backward_args(dtype, entry.hdim, entry.hdim_v, kernel.varlen,
                              seqused=(kernel.has_seqused_q, kernel.has_seqused_k),
                              dropout=kernel.dropout, mods=kernel.mods)
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes,
                       options=COMPILE_OPTIONS)


def _fwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}),
                           ((96, 96), {}), ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((256, 256), {"causal": True}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_q": True,
                                         "seqused_k": True}),
                           ((128, 128), {"dropout": True}),
                           ((64, 64), {"causal": True, "varlen": True, "dropout": True}),
                           # Dropout at a ring step's global coordinates (`rng.framed_seed`).
                           ((128, 128), {"causal": True, "dropout": "shift"}),
                           ((64, 64), {"varlen": True, "dropout": "frame"}),
                           # Split-KV decode: cache lengths (seqused_k), causal, varlen.
                           ((128, 128), {"causal": True, "seqused_k": True, "split_kv": True}),
                           ((64, 64), {"varlen": True, "seqused_k": True, "split_kv": True}),
                           # The software exp2 on 2 and 4 of every 16 scores (`exp2_emu`).
                           ((128, 128), {"causal": True, "ex2_emu": 2}),
                           ((128, 128), {"causal": True, "ex2_emu": 4}),
                           # Traced mods (`variants.examples`): a bias, a mask, both.
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           # FA4-form mods (`fa4_mod_examples`): a derivative from dual
                           # numbers with a mask mod, an aux tensor and aux scalars.
                           ((128, 128), {"mods": "fa4_softcap_causal"}),
                           ((64, 64), {"mods": "fa4_head_bias"}),
                           ((128, 128), {"mods": "fa4_scaled_shift"}),
                           ((128, 128), {"mods": "fa4_softcap_causal+blocks"}),
                           ((128, 128), {"mods": "document"}),
                           ((64, 64), {"varlen": True, "mods": "alibi_document"}),
                           ((128, 128), {"causal": True, "mods": "document+blocks"})]:
        targets = SM100_TOO if (d, flags) == (128, {"causal": True}) else TARGETS
        out.append(KernelConfig("ampere.fwd", targets, "bf16", d, dv, FWD_SCHEDULES[d],
                                build_fwd, config_flags(**{**_SWITCHES, **flags})))
    return tuple(out)


def _bwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True}),
                           ((128, 128), {"dropout": True}),
                           ((64, 64), {"causal": True, "varlen": True, "softcap": True,
                                       "dropout": True}),
                           ((128, 128), {"causal": True, "dropout": "shift"}),
                           ((128, 128), {"causal": True, "dropout": "frame"}),
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           # FA4-form mods (`fa4_mod_examples`): a derivative from dual
                           # numbers with a mask mod, and an aux tensor.
                           ((128, 128), {"mods": "fa4_softcap_causal"}),
                           ((64, 64), {"mods": "fa4_head_bias"}),
                           ((128, 128), {"mods": "document"}),
                           ((64, 64), {"mods": "softcap"}),
                           ((128, 128), {"causal": True, "mods": "document+blocks"}),
                           # Gradients of learnable captured tensors (`KernelMods.aux_grads`).
                           ((128, 128), {"causal": True, "mods": "alibi+grads"}),
                           ((64, 64), {"mods": "relative_bias+grads"}),
                           ((64, 64), {"mods": "row_col_bias+grads"})]:
        out.append(KernelConfig("ampere.bwd", TARGETS, "bf16", d, dv, BWD_SCHEDULES[d][:3],
                                build_bwd, config_flags(**{**_SWITCHES, **flags})))
    return tuple(out)


CONFIGS = _fwd_configs() + _bwd_configs()
