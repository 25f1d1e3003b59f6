"""The table of kernel configurations that `inspect` cross-compiles and reports.

Data only (no CuTe DSL import), so listing and filtering it is free. Each entry names a builder
``"module:function"`` that, inside a compile worker, returns what to hand to ``cute.compile``
(see `flash_cute.xcompile`). A kernel is named ``<module>.<role>``: ``ampere.fwd``,
``hopper.bwd``, ... for the attention pipelines, ``blocks.*`` for the shared blocks' own kernels.
"""

from dataclasses import dataclass, field

from flash_cute.arch.ampere.config import BWD_TILES as AMPERE_BWD_TILES
from flash_cute.arch.ampere.config import TILES as AMPERE_TILES
from flash_cute.arch.hopper.config import BWD_TILES as HOPPER_BWD_TILES
from flash_cute.arch.hopper.config import BwdConfig as HopperBwdConfig
from flash_cute.arch.hopper.config import bwd_tile as hopper_bwd_tile
from flash_cute.arch.hopper.config import TILES as HOPPER_TILES
from flash_cute.arch.hopper.config import fwd_tile as hopper_fwd_tile

ARCHES = ("sm_80", "sm_90a", "sm_100a")


@dataclass(frozen=True)
class KernelConfig:
    kernel: str
    archs: tuple
    dtype: str
    hdim: object
    hdim_v: object
    tile: tuple
    builder: str
    flags: tuple = field(default=())

    @property
    def flag_dict(self) -> dict:
        return dict(self.flags)

    @property
    def label(self) -> str:
        """Short unique description, e.g. ``bf16 d-/16 64x64 causal``."""
        on = [k if v is True else f"{k}={v}" for k, v in self.flags if v is not False]
        dims = f"d{self.hdim if self.hdim is not None else '-'}/{self.hdim_v}"
        return " ".join([self.dtype, dims, tile_label(self.tile)] + on)

    def config_dict(self) -> dict:
        names = getattr(self.tile, "_fields", ())
        nums = list(self.tile[:3]) if names else [x for x in self.tile if not isinstance(x, bool)]
        cfg = {"dtype": self.dtype, "hdim": self.hdim, "hdim_v": self.hdim_v, "tile": nums}
        # A schedule's named switches (e.g. the Hopper forward's overlaps) read like flags, and
        # so do its named numbers past the leading three (the backward's do_stages), when set.
        cfg.update({n: x for n, x in zip(names[3:], self.tile[3:]) if x is not None})
        cfg.update(self.flag_dict)
        return cfg


def tile_label(tile) -> str:
    """``128x128x2`` from the leading numbers; a named schedule switch that is on adds
    ``+name``, a named number that is set ``+name=value`` (``64x48x2+swap_dkv+do_stages=1``)."""
    names = getattr(tile, "_fields", ())
    lead = [str(x) for x in tile[:3]] if names else [str(x) for x in tile]
    extra = []
    for n, x in zip(names[3:], tile[3:]):
        if x is True:
            extra.append(f"+{n}")
        elif not isinstance(x, bool) and x is not None:
            extra.append(f"+{n}={x}")
    return "x".join(lead) + "".join(extra)


def _flags(**kw) -> tuple:
    return tuple(sorted(kw.items()))


_SOFTMAX_ROWS = "flash_cute.score_attention:build_for_inspect"
_AMPERE_FWD = "flash_cute.arch.ampere.fwd:build_for_inspect"
_AMPERE_BWD = "flash_cute.arch.ampere.bwd:build_for_inspect"
# Every switch of an ampere config, off unless the entry turns it on.
_AMPERE_SWITCHES = {"causal": False, "local": False, "softcap": False, "varlen": False,
                    "seqused_q": False, "seqused_k": False}


def _ampere_fwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}),
                           ((96, 96), {}), ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((256, 256), {"causal": True}),
                           ((128, 128), {"causal": True, "varlen": True, "seqused_q": True,
                                         "seqused_k": True})]:
        full = {**_AMPERE_SWITCHES, **flags}
        out.append(KernelConfig("ampere.fwd", ("sm_80",), "bf16", d, dv, AMPERE_TILES[d],
                                _AMPERE_FWD, _flags(**full)))
    return tuple(out)


def _ampere_bwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True})]:
        full = {**_AMPERE_SWITCHES, **flags}
        out.append(KernelConfig("ampere.bwd", ("sm_80",), "bf16", d, dv, AMPERE_BWD_TILES[d][:3],
                                _AMPERE_BWD, _flags(**full)))
    return tuple(out)


_HOPPER_FWD = "flash_cute.arch.hopper.fwd:build_for_inspect"


def _hopper_fwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((256, 256), {"causal": True}), ((64, 64), {"fp16": True}),
                           ((256, 256), {"local": True, "softcap": True, "varlen": True}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True, "seqused_k": True})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        full = {"causal": False, "local": False, "softcap": False, "varlen": False, **flags}
        out.append(KernelConfig("hopper.fwd", ("sm_90a",), dtype, d, dv, HOPPER_TILES[d],
                                _HOPPER_FWD, _flags(**full)))
    # The overlap ablation: each FA3 overlap on its own, and neither.
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False}
    for overlap, pingpong in [(False, False), (True, True), (False, True)]:
        tile = HOPPER_TILES[128]._replace(intra_wg_overlap=overlap, pingpong=pingpong)
        out.append(KernelConfig("hopper.fwd", ("sm_90a",), "bf16", 128, 128, tile, _HOPPER_FWD,
                                _flags(**plain)))
    # hdim 64's 192-row tile (three consumer warpgroups) against two warpgroups' 128 rows
    # (also the default for causal problems up to `SHORT_CAUSAL_ROWS` query rows), and with
    # the ring of turns off, then the serial main loop (two turns per block).
    for tile in (HOPPER_TILES[64]._replace(tile_m=128), HOPPER_TILES[64]._replace(pingpong=False),
                 HOPPER_TILES[64]._replace(intra_wg_overlap=False)):
        out.append(KernelConfig("hopper.fwd", ("sm_90a",), "bf16", 64, 64, tile, _HOPPER_FWD,
                                _flags(**{**plain, "causal": True})))
    # hdim 256's short causal tile (64 key columns, `SHORT_CAUSAL_TILE_N`).
    out.append(KernelConfig("hopper.fwd", ("sm_90a",), "bf16", 256, 256,
                            hopper_fwd_tile(256, short=True), _HOPPER_FWD,
                            _flags(**{**plain, "causal": True})))
    # The persistent scheduler flipped from the table's choice (on at hdim 128; hdim 64's
    # 192-row tile runs persistent only, and its 128-row one is persistent above): plain
    # and causal (LPT order), varlen (tiles past a sequence skipped), and O's shared tile
    # aliasing Q (hdim 192 and 256).
    for (d, dv), flags in [((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((192, 192), {}), ((256, 256), {"causal": True})]:
        tile = HOPPER_TILES[d]._replace(persistent=not HOPPER_TILES[d].persistent)
        out.append(KernelConfig("hopper.fwd", ("sm_90a",), "bf16", d, dv, tile, _HOPPER_FWD,
                                _flags(**{**plain, **flags})))
    # Packed GQA (query heads of a K/V head in one tile): O by TMA store from its own tile or
    # Q's, and by row stores (varlen, seqused_q).
    for (d, dv), flags in [((128, 128), {"causal": True, "pack_gqa": 4}),
                           ((256, 256), {"causal": True, "pack_gqa": 2}),
                           ((64, 64), {"local": True, "softcap": True, "varlen": True,
                                       "pack_gqa": 8}),
                           ((128, 128), {"seqused_q": True, "seqused_k": True, "pack_gqa": 16})]:
        rows_past_sequence = flags.get("varlen", False) or flags.get("seqused_q", False)
        out.append(KernelConfig("hopper.fwd", ("sm_90a",), "bf16", d, dv,
                                hopper_fwd_tile(d, flags["pack_gqa"], rows_past_sequence),
                                _HOPPER_FWD,
                                _flags(**{**plain, **flags})))
    return tuple(out)


_HOPPER_BWD = "flash_cute.arch.hopper.bwd:build_for_inspect"


def _hopper_bwd_configs():
    out = []
    for (d, dv), flags in [((64, 64), {}), ((64, 64), {"causal": True}), ((96, 96), {}),
                           ((128, 128), {}), ((128, 128), {"causal": True}),
                           ((128, 128), {"local": True, "softcap": True}),
                           ((128, 128), {"causal": True, "varlen": True}),
                           ((128, 128), {"dkv_fp32": True}), ((64, 64), {"fp16": True}),
                           ((192, 192), {}), ((192, 128), {"causal": True}), ((256, 256), {}),
                           ((128, 128), {"causal": True, "deterministic": True}),
                           ((128, 128), {"local": True, "varlen": True, "deterministic": True}),
                           ((256, 256), {"causal": True, "deterministic": True}),
                           ((128, 128), {"causal": True, "seqused_q": True, "seqused_k": True}),
                           ((64, 64), {"varlen": True, "seqused_q": True, "seqused_k": True})]:
        dtype = "fp16" if flags.pop("fp16", False) else "bf16"
        full = {"causal": False, "local": False, "softcap": False, "varlen": False,
                "dkv_fp32": False, "deterministic": False, **flags}
        out.append(KernelConfig("hopper.bwd", ("sm_90a",), dtype, d, dv,
                                hopper_bwd_tile(d, full["varlen"]), _HOPPER_BWD,
                                _flags(**full)))
    plain = {"causal": False, "local": False, "softcap": False, "varlen": False,
             "dkv_fp32": False, "deterministic": False}
    # The default hdim-128 tile (80 query rows, transposed scores, dQᵀ) against 64 rows with
    # P through shared memory and 64 rows with transposed scores (P kept in registers; also
    # the default for causal problems up to `SHORT_CAUSAL_BWD_ROWS`).
    for swap in (False, True):
        out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 128, 128,
                                HOPPER_BWD_TILES[128]._replace(tile_m=64, swap_sdp=swap),
                                _HOPPER_BWD, _flags(**{**plain, "causal": swap})))
    # The default hdim-128 tile with the whole dQ tile handed over at once (no dq_per_wg).
    out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 128, 128,
                            HOPPER_BWD_TILES[128]._replace(dq_per_wg=False), _HOPPER_BWD,
                            _flags(**{**plain, "causal": True})))
    # 64 query rows at hdim 64 against the default 128 (shuffled LSE₂/Δ).
    out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 64, 64,
                            HOPPER_BWD_TILES[64]._replace(tile_m=64), _HOPPER_BWD,
                            _flags(**{**plain, "causal": True})))
    # hdim 256 at 64 keys against the default 48 with dK/dV transposed: dQ by fp32 atomics
    # (two Q/dO stages leave no room for the dQ tile), plain and deterministic, and one
    # Q/dO stage with the bulk reduce-add (the default before swap_dkv).
    for det in (False, True):
        out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 256, 256,
                                HopperBwdConfig(64, 64, 2), _HOPPER_BWD,
                                _flags(**{**plain, "causal": det, "deterministic": det})))
    out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 256, 256,
                            HopperBwdConfig(64, 64, 1), _HOPPER_BWD, _flags(**plain)))
    # hdim 192 at 64 keys, two Q/dO stages (the default before swap_dkv).
    out.append(KernelConfig("hopper.bwd", ("sm_90a",), "bf16", 192, 192,
                            HopperBwdConfig(64, 64, 2), _HOPPER_BWD, _flags(**plain)))
    return tuple(out)


_HOPPER_DQ_POST = "flash_cute.arch.hopper.dq_accum:build_postprocess_for_inspect"


def _hopper_dq_postprocess_configs():
    """The postprocess of the Hopper backward's fragment-order dQaccum, per default tile (its
    config's tile is the backward schedule it belongs to; `short`: `config.short_causal`)."""
    return tuple(KernelConfig("hopper.bwd.dq_postprocess", ("sm_90a",), dtype, d, None,
                              hopper_bwd_tile(d, varlen, short), _HOPPER_DQ_POST,
                              _flags(varlen=varlen))
                 for d, dtype, varlen, short in [(64, "bf16", False, False),
                                                 (96, "bf16", False, False),
                                                 (128, "bf16", False, False),
                                                 (128, "fp16", True, False),
                                                 (128, "bf16", False, True),
                                                 (192, "bf16", False, False),
                                                 (256, "bf16", True, False)])


_LSE_MERGE = "flash_cute.lse_merge:build_for_inspect"

CONFIGS = (
    KernelConfig("blocks.softmax_rows", ARCHES, "bf16", None, 16, (64, 64), _SOFTMAX_ROWS,
                 _flags(causal=False, local=False, softcap=False)),
    KernelConfig("blocks.softmax_rows", ARCHES, "bf16", None, 16, (64, 64), _SOFTMAX_ROWS,
                 _flags(causal=True, local=False, softcap=True)),
    KernelConfig("blocks.softmax_rows", ARCHES, "fp16", None, 16, (64, 64), _SOFTMAX_ROWS,
                 _flags(causal=False, local=True, softcap=False)),
    KernelConfig("blocks.lse_merge", ARCHES, "bf16", 128, 128, (4, 128), _LSE_MERGE),
) + _ampere_fwd_configs() + _ampere_bwd_configs() + _hopper_fwd_configs() \
    + _hopper_bwd_configs() + _hopper_dq_postprocess_configs()

_BWD_PREP = "flash_cute.bwd_prep:build_for_inspect"
CONFIGS += (
    KernelConfig("blocks.bwd.preprocess", ARCHES, "bf16", None, 128, (64, 128), _BWD_PREP,
                 _flags(dlse=False, varlen=False, seqused_q=False, zero_fill=True)),
    KernelConfig("blocks.bwd.preprocess", ARCHES, "fp16", None, 64, (128, 64), _BWD_PREP,
                 _flags(dlse=True, varlen=True, seqused_q=False)),
    KernelConfig("blocks.bwd.preprocess", ARCHES, "bf16", None, 128, (64, 128), _BWD_PREP,
                 _flags(dlse=False, varlen=True, seqused_q=True)),
    KernelConfig("blocks.bwd.postprocess", ARCHES, "bf16", 128, None, (32, 128), _BWD_PREP,
                 _flags(varlen=False)),
)


def registered_configs(kernel=None, arch=None) -> list:
    """Configs whose kernel name matches `kernel` (exact, or a prefix ending in '.') and arch."""
    out = []
    for cfg in CONFIGS:
        if kernel and not (cfg.kernel == kernel or cfg.kernel.startswith(kernel.rstrip(".") + ".")):
            continue
        if arch and arch not in cfg.archs:
            continue
        out.append(cfg)
    return out
