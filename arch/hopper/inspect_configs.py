"""The hopper pipeline's kernel configs for `inspect`, and how each is built for compiling."""

from flash_cute.tools.kernel_config import KernelConfig, config_flags

from .config import (
    BWD_SCHEDULES,
    COMPILE_OPTIONS,
    DECODE_PAIR,
    FP8_SCHEDULES,
    FWD_SCHEDULES,
    BwdSchedule,
    bwd_compile_options,
    bwd_schedule,
    fwd_schedule,
)

TARGETS = ("sm_90a",)


def build_fwd(entry):
    """Fake padded or varlen Q/K/V/O/LSE with dynamic batch and lengths."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.kernel_config import forward_spec, variant_from_flags

    from .fwd import HopperFwd, registers_per_role

    kernel = HopperFwd(DTYPES[entry.dtype], entry.hdim, entry.hdim_v,
                       variant_from_flags(entry.flag_dict), schedule=tuple(entry.schedule))
    return forward_spec(kernel, COMPILE_OPTIONS,
                        {"registers_per_role": registers_per_role(kernel)})


def build_fwd_fp8(entry):
    """Fake e4m3 Q/K/V, a bf16 (fp16 with the flag) O and the descales."""
    import cutlass

    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.kernel_config import forward_spec, variant_from_flags

    from .fwd_fp8 import HopperFwdFp8, registers_per_role

    flags = entry.flag_dict
    out_dtype = cutlass.Float16 if flags.get("out_fp16") else cutlass.BFloat16
    kernel = HopperFwdFp8(DTYPES[entry.dtype], entry.hdim, entry.hdim_v,
                          variant_from_flags(flags), schedule=tuple(entry.schedule),
                          out_dtype=out_dtype, block_scales=flags.get("block_scales", False))
    return forward_spec(kernel, COMPILE_OPTIONS,
                        {"registers_per_role": registers_per_role(kernel)})


def build_bwd(entry):
    """Fake padded or varlen tensors with dynamic batch, heads and lengths; the alignments
    and dQaccum layout `planner.plan_backward` promises (its `_bwd_plan`: TMA-ready 16-byte
    rows of LSE₂, Δ, dQaccum)."""
    from flash_cute.runtime.jit import DTYPES
    from flash_cute.tools.fake_args import fake_backward_args
    from flash_cute.tools.kernel_config import CompileSpec, variant_from_flags

    from .bwd import HopperBwd, registers_per_role

    dtype = DTYPES[entry.dtype]
    flags = entry.flag_dict
    kernel = HopperBwd(dtype, entry.hdim, entry.hdim_v, variant_from_flags(flags),
                       schedule=tuple(entry.schedule),
                       deterministic=flags.get("deterministic", False))
    args = fake_backward_args(dtype, entry.hdim, entry.hdim_v, kernel.varlen,
                              dkv_fp32=flags.get("dkv_fp32", False), stats_align=16,
                              dq_align=16, semaphores=kernel.deterministic,
                              seqused=(kernel.has_seqused_q, kernel.has_seqused_k),
                              dropout=kernel.dropout, mods=kernel.mods,
                              timeline=kernel.timeline,
                              dq_accum_cols=(entry.schedule[0] * entry.hdim if kernel.dq_tma
                                             else None))
    return CompileSpec(kernel, args, dynamic_smem_bytes=kernel.smem_bytes,
                       options=bwd_compile_options(entry.schedule),
                       extra={"registers_per_role": registers_per_role()})


def build_dq_postprocess(entry):
    """``hopper.bwd.dq_postprocess``: fake padded or varlen tensors."""
    from cutlass import Float32, Int32

    from flash_cute.arch.hopper.host_dq_layout import TiledDqAccum
    from flash_cute.runtime.jit import DTYPES, dynamic_dim, fake_stream, fake_tensor
    from flash_cute.tools.kernel_config import CompileSpec

    from .dq_accum import HopperDqPostprocess

    dtype = DTYPES[entry.dtype]
    varlen = entry.flag_dict["varlen"]
    # The registered schedule is the backward's whose dQaccum this kernel reads.
    layout = TiledDqAccum.of(entry.schedule, entry.hdim)
    tile_m = layout.tile_m
    out_dtype = Float32 if entry.flag_dict.get("fp32_out") else dtype
    kernel = HopperDqPostprocess(dtype, entry.hdim, tile_m, layout.split, varlen, layout.swapped,
                                 out_dtype)
    heads = dynamic_dim()
    chunk = tile_m * entry.hdim
    if varlen:
        accum = fake_tensor(Float32, (dynamic_dim(), heads, chunk))
        dq = fake_tensor(out_dtype, (dynamic_dim(), heads, entry.hdim))
        cu = fake_tensor(Int32, (dynamic_dim(),), align=4)
    else:
        batch = dynamic_dim()
        accum = fake_tensor(Float32, (batch, dynamic_dim(), heads, chunk))
        dq = fake_tensor(out_dtype, (batch, dynamic_dim(), heads, entry.hdim))
        cu = None
    return CompileSpec(kernel, (accum, dq, Float32(0.125), cu, Int32(1), fake_stream()))


def _fwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((256, 256), {"causal": True}), ((64, 64), {"fp16": True}),
                           ((256, 256), {"local": True, "softcap": True, "varlen": True}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True, "seqused_k": True}),
                           ((128, 128), {"dropout": True}),
                           ((128, 128), {"causal": True, "varlen": True, "dropout": True}),
                           ((64, 64), {"causal": True, "dropout": True}),
                           # Dropout at a ring step's global coordinates (`rng.framed_seed`).
                           ((128, 128), {"causal": True, "dropout": "shift"}),
                           ((128, 128), {"causal": True, "dropout": "frame"}),
                           ((64, 64), {"varlen": True, "dropout": "frame"}),
                           # Split-KV decode: packed GQA, causal, cache lengths (seqused_k).
                           ((128, 128), {"split_kv": True, "pack_gqa": 4}),
                           ((128, 128), {"causal": True, "seqused_k": True, "split_kv": True,
                                         "pack_gqa": 8}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_k": True,
                                         "split_kv": True}),
                           ((64, 64), {"split_kv": True, "pack_gqa": 4}),
                           # Paged K/V: boxes of 16 rows, of 64, one page per block (256).
                           ((128, 128), {"seqused_k": True, "split_kv": True, "pack_gqa": 4,
                                         "page": 16}),
                           ((128, 128), {"causal": True, "seqused_k": True, "pack_gqa": 4,
                                         "page": 64}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_k": True,
                                         "split_kv": True, "page": 256}),
                           # The decode step's in-place append (`kv_append`), dense and paged.
                           ((128, 128), {"causal": True, "seqused_k": True, "split_kv": True,
                                         "pack_gqa": 4, "append": True}),
                           ((128, 128), {"causal": True, "seqused_k": True, "split_kv": True,
                                         "pack_gqa": 4, "page": 16, "append": True}),
                           ((256, 256), {"causal": True, "split_kv": True}),
                           # The measured timeline (`timeline`): records at the warp roles'
                           # phase boundaries, causal and not.
                           ((128, 128), {"causal": True, "timeline": True}),
                           ((128, 128), {"timeline": True}),
                           # The software exp2 on 2 and 4 of every 16 scores (`exp2_emu`).
                           ((128, 128), {"causal": True, "ex2_emu": 2}),
                           ((128, 128), {"causal": True, "ex2_emu": 4}),
                           # Traced mods (`variants.examples`): a bias, a mask, both, packed GQA.
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           # FA4-form mods (`fa4_mod_examples`): a derivative from dual
                           # numbers with a mask mod, an aux tensor and aux scalars.
                           ((128, 128), {"mods": "fa4_softcap_causal"}),
                           ((64, 64), {"mods": "fa4_head_bias"}),
                           ((128, 128), {"mods": "fa4_scaled_shift"}),
                           ((128, 128), {"mods": "fa4_softcap_causal+blocks"}),
                           ((128, 128), {"mods": "document"}),
                           ((128, 128), {"varlen": True, "mods": "alibi_document"}),
                           ((128, 128), {"causal": True, "pack_gqa": 4,
                                         "mods": "relative_bias"}),
                           ((64, 64), {"mods": "softcap"}),
                           # Block sparsity: a block mask's empty tiles skipped, full ones
                           # without the mask rule.
                           ((128, 128), {"causal": True, "mods": "document+blocks"}),
                           # A block mask the heads share, on packed GQA rows (D-PACK-BLOCKS).
                           ((128, 128), {"causal": True, "pack_gqa": 4,
                                         "mods": "document+blocks"}),
                           ((128, 128), {"mods": "fa4_alibi_causal"}),
                           ((128, 128), {"mods": "fa4_document"})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        full = {"causal": False, "local": False, "softcap": False, "varlen": False, **flags}
        out.append(KernelConfig("hopper.fwd", TARGETS, dtype, d, dv,
                                fwd_schedule(d, flags.get("pack_gqa", 1),
                                             flags.get("varlen", False)
                                             or flags.get("split_kv", False),
                                             dropout=flags.get("dropout", False)),
                                build_fwd, config_flags(**full)))
    # The overlap ablation: each FA3 overlap on its own, and neither.
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False}
    for overlap, pingpong in [(False, False), (True, False), (False, True)]:
        schedule = FWD_SCHEDULES[128]._replace(intra_wg_overlap=overlap, pingpong=pingpong)
        out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", 128, 128, schedule, build_fwd,
                                config_flags(**plain)))
    # hdim 64's 192-row tile (three consumer warpgroups) against two warpgroups' 128 rows
    # (also the default for causal problems up to `SHORT_CAUSAL_ROWS` query rows), and with
    # the ring of turns off, then the serial main loop (two turns per block).
    hdim64 = FWD_SCHEDULES[64]
    for schedule in (hdim64._replace(tile_m=128), hdim64._replace(pingpong=False),
                     hdim64._replace(intra_wg_overlap=False)):
        out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", 64, 64, schedule, build_fwd,
                                config_flags(**{**plain, "causal": True})))
    # hdim 256's short causal tile (64 key columns, `SHORT_CAUSAL_TILE_N`).
    out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", 256, 256,
                            fwd_schedule(256, short=True), build_fwd,
                            config_flags(**{**plain, "causal": True})))
    # The persistent scheduler flipped from the table's choice (on at hdim 128; hdim 64's
    # 192-row tile runs persistent only, and its 128-row one is persistent above): plain
    # and causal (LPT order), varlen (tiles past a sequence skipped), and O's shared tile
    # aliasing Q (hdim 192 and 256).
    for (d, dv), flags in [((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((256, 256), {"causal": True})]:
        schedule = FWD_SCHEDULES[d]._replace(persistent=not FWD_SCHEDULES[d].persistent)
        out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", d, dv, schedule, build_fwd,
                                config_flags(**{**plain, **flags})))
    # The decode schedule of two CTAs per SM (`config.DECODE_PAIR`), dense and paged.
    for flags in ({"causal": True, "seqused_k": True, "split_kv": True, "pack_gqa": 4},
                  {"seqused_k": True, "split_kv": True, "pack_gqa": 4, "page": 16}):
        out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", 128, 128, DECODE_PAIR,
                                build_fwd, config_flags(**{**plain, **flags})))
    # Packed GQA (query heads of a K/V head in one tile): O by TMA store from its own tile or
    # Q's, and by row stores (varlen, seqused_q).
    for (d, dv), flags in [((128, 128), {"causal": True, "pack_gqa": 4}),
                           ((256, 256), {"causal": True, "pack_gqa": 2}),
                           ((64, 64), {"local": True, "softcap": True, "varlen": True,
                                       "pack_gqa": 8}),
                           ((128, 128), {"seqused_q": True, "seqused_k": True, "pack_gqa": 16})]:
        rows_past_sequence = flags.get("varlen", False) or flags.get("seqused_q", False)
        out.append(KernelConfig("hopper.fwd", TARGETS, "bf16", d, dv,
                                fwd_schedule(d, flags["pack_gqa"], rows_past_sequence),
                                build_fwd,
                                config_flags(**{**plain, **flags})))
    return tuple(out)


def _bwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((128, 128), {"dkv_fp32": True}), ((64, 64), {"fp16": True}),
                           # The measured timeline (`timeline`), causal and not.
                           ((128, 128), {"causal": True, "timeline": True}),
                           ((128, 128), {"timeline": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((128, 128), {"causal": True, "deterministic": True}),
                           ((128, 128), {"local": True, "varlen": True, "deterministic": True}),
                           ((256, 256), {"causal": True, "deterministic": True}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True, "seqused_k": True}),
                           ((128, 128), {"dropout": True}),
                           ((128, 128), {"causal": True, "varlen": True, "dropout": True}),
                           ((64, 64), {"causal": True, "dropout": True}),
                           ((128, 128), {"softcap": True, "dropout": True}),
                           ((256, 256), {"causal": True, "dropout": True}),
                           ((128, 128), {"causal": True, "dropout": "shift"}),
                           ((128, 128), {"causal": True, "dropout": "frame"}),
                           ((64, 64), {"varlen": True, "dropout": "frame"}),
                           # Traced mods: biases (derivative 1), a mask, a derivative kept
                           # in registers (softcap as a mod).
                           ((128, 128), {"causal": True, "mods": "alibi"}),
                           # FA4-form mods (`fa4_mod_examples`): a derivative from dual
                           # numbers with a mask mod, an aux tensor and aux scalars.
                           ((128, 128), {"mods": "fa4_softcap_causal"}),
                           ((64, 64), {"mods": "fa4_head_bias"}),
                           ((128, 128), {"mods": "fa4_scaled_shift"}),
                           ((128, 128), {"mods": "document"}),
                           ((64, 64), {"mods": "relative_bias"}),
                           ((128, 128), {"mods": "softcap"}),
                           ((64, 64), {"causal": True, "mods": "softcap"}),
                           ((128, 128), {"causal": True, "mods": "document+blocks"}),
                           # Gradients of learnable captured tensors: ALiBi's slopes (an
                           # index uniform over a tile), a relative-bias table (per element).
                           ((128, 128), {"causal": True, "mods": "alibi+grads"}),
                           ((128, 128), {"mods": "relative_bias+grads"}),
                           ((128, 128), {"mods": "fa4_alibi_causal"}),
                           ((128, 128), {"mods": "fa4_document"}),
                           ((128, 128), {"mods": "row_col_bias+grads"})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        full = {"causal": False, "local": False, "softcap": False, "varlen": False,
                "dkv_fp32": False, "deterministic": False, **flags}
        out.append(KernelConfig("hopper.bwd", TARGETS, dtype, d, dv,
                                bwd_schedule(d, full["varlen"], dropout=full.get("dropout", False),
                                             mods="mods" in full),
                                build_bwd,
                                config_flags(**full)))
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False,
             "dkv_fp32": False, "deterministic": False}
    # The default hdim-128 tile (80 query rows, transposed scores, dQᵀ) against 64 rows with
    # P through shared memory and 64 rows with transposed scores (P kept in registers; also
    # the default for causal problems up to `SHORT_CAUSAL_BWD_ROWS`).
    for swap in (False, True):
        out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 128, 128,
                                BWD_SCHEDULES[128]._replace(tile_m=64, swap_sdp=swap),
                                build_bwd, config_flags(**{**plain, "causal": swap})))
    # The default hdim-128 tile with the whole dQ tile handed over at once (no dq_per_wg).
    out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 128, 128,
                            BWD_SCHEDULES[128]._replace(dq_per_wg=False), build_bwd,
                            config_flags(**{**plain, "causal": True})))
    # 64 query rows at hdim 64 against the default 128 (shuffled LSE₂/Δ).
    out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 64, 64,
                            BWD_SCHEDULES[64]._replace(tile_m=64), build_bwd,
                            config_flags(**{**plain, "causal": True})))
    # hdim 256 at 64 keys against the default 48 with dK/dV transposed: dQ by fp32 atomics
    # (two Q/dO stages leave no room for the dQ tile), plain and deterministic, and one
    # Q/dO stage with the bulk reduce-add (the default before swap_dkv).
    for det in (False, True):
        out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 256, 256,
                                BwdSchedule(64, 64, 2), build_bwd,
                                config_flags(**{**plain, "causal": det, "deterministic": det})))
    out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 256, 256,
                            BwdSchedule(64, 64, 1), build_bwd, config_flags(**plain)))
    # hdim 192 at 64 keys, two Q/dO stages (the default before swap_dkv).
    out.append(KernelConfig("hopper.bwd", TARGETS, "bf16", 192, 192,
                            BwdSchedule(64, 64, 2), build_bwd, config_flags(**plain)))
    return tuple(out)


def _dq_postprocess_configs():
    """The postprocess of the Hopper backward's fragment-order dQaccum, per default schedule
    (its entry's schedule is the backward schedule it belongs to; `short`:
    `config.short_causal`), and with a float32 dQ (a ring step's `grads_fp32`)."""
    cases = [(64, "bf16", False, False, {}), (96, "bf16", False, False, {}),
             (128, "bf16", False, False, {}), (128, "fp16", True, False, {}),
             (128, "bf16", False, True, {}), (192, "bf16", False, False, {}),
             (256, "bf16", True, False, {}),
             (128, "bf16", False, False, {"fp32_out": True}),
             (128, "bf16", True, False, {"fp32_out": True}),
             (256, "bf16", False, False, {"fp32_out": True})]
    return tuple(KernelConfig("hopper.bwd.dq_postprocess", TARGETS, dtype, d, None,
                              bwd_schedule(d, varlen, short), build_dq_postprocess,
                              config_flags(varlen=varlen, **extra))
                 for d, dtype, varlen, short, extra in cases)


def _fwd_fp8_configs():
    """The FP8 forward at each head dim it takes, and its features."""
    cases = [((64, 64), {}), ((128, 128), {}), ((128, 128), {"causal": True}),
             ((192, 128), {"causal": True}), ((256, 256), {}), ((256, 256), {"causal": True}),
             ((128, 128), {"local": True, "softcap": True}),
             ((128, 128), {"causal": True, "varlen": True, "seqused_k": True}),
             ((128, 128), {"causal": True, "pack_gqa": 4, "out_fp16": True}),
             # Decode: split-KV with packed GQA over cache lengths, dense and paged.
             ((128, 128), {"split_kv": True, "pack_gqa": 4, "seqused_k": True}),
             ((128, 128), {"causal": True, "split_kv": True, "pack_gqa": 8, "seqused_k": True,
                           "page": 64}),
             ((256, 256), {"split_kv": True, "seqused_k": True, "page": 64}),
             # Block scales (per 128 tokens of a head).
             ((128, 128), {"block_scales": True}),
             ((128, 128), {"causal": True, "block_scales": True, "varlen": True,
                           "pack_gqa": 4}),
             ((256, 256), {"causal": True, "block_scales": True})]
    out = [KernelConfig("hopper.fwd_fp8", TARGETS, "e4m3", d, dv, FP8_SCHEDULES[d],
                        build_fwd_fp8, config_flags(**flags)) for (d, dv), flags in cases]
    # FA3's 128 x 224 at hdim 128, measured against the default by bench/fp8_tiles.py.
    out += [KernelConfig("hopper.fwd_fp8", TARGETS, "e4m3", 128, 128,
                         FP8_SCHEDULES[128]._replace(tile_n=224), build_fwd_fp8,
                         config_flags(causal=True))]
    # e5m2 inputs (P stays e4m3: QGMMA E4M3 x E5M2 for PV).
    out += [KernelConfig("hopper.fwd_fp8", TARGETS, "e5m2", 128, 128, FP8_SCHEDULES[128],
                         build_fwd_fp8, config_flags(causal=True))]
    return tuple(out)


CONFIGS = _fwd_configs() + _fwd_fp8_configs() + _bwd_configs() + _dq_postprocess_configs()
