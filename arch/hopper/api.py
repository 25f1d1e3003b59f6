"""Host entry of the Hopper pipeline: what it supports, and the forward and backward launches."""

import functools

import torch

from flash_cute import launch
from flash_cute.validation import AttentionProblem

from .config import (BWD_SUPPORTED_HDIMS, COMPILE_OPTIONS, PACK_ROWS, SHORT_CAUSAL_BWD_ROWS,
                     SUPPORTED_HDIMS, TILES, BwdConfig, bwd_compile_options, bwd_smem_plan,
                     bwd_tile, fwd_tile, short_causal)

# forward/backward take seqused_q/seqused_k (the dispatcher reads this without importing the DSL).
SUPPORTS_SEQUSED = True
# The forward packs a K/V head's query heads into one tile (`launch.packed_heads`); the
# backward runs unpacked (its outputs do not depend on how the forward tiled).
SUPPORTS_PACK_GQA = True

# deterministic=True adds each query tile's dQ partials in a fixed order (a semaphore per
# query tile, `HopperBwd`); GQA's dK/dV are summed on the host in a fixed order.
DETERMINISTIC_BACKWARD = True


def default_for(problem: AttentionProblem) -> bool:
    """Whether the dispatcher picks this pipeline on its own: for every problem it supports.
    Varlen tiles that TMA loads past a sequence (the next sequence, or the unused tail of the
    packed tensor) get those rows zeroed in shared memory before a GEMM reads them
    (`HopperFwd.clear_v_tail`, `BwdStep.clear_tail`)."""
    return True


def check_supported(problem: AttentionProblem, device=None, backward: bool = False) -> None:
    """Head dims with a kernel (the tiles are sized for the H100/H200's 227 KiB), and a
    group that divides the tile when pack_gqa=True."""
    launch.check_head_dims("hopper", problem, SUPPORTED_HDIMS)
    # Raises for pack_gqa=True with a group that does not divide the tile.
    launch.packed_heads(problem, PACK_ROWS)
    if backward:
        launch.check_head_dims("hopper backward", problem, BWD_SUPPORTED_HDIMS)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of its size-1 dims made compact.

    Validation ignores those strides (the kernel never steps along them), but a TMA descriptor
    encodes every stride and rejects one that is not a multiple of 16 bytes.
    """
    shape, stride = t.shape, t.stride()
    if all(s % 8 == 0 or n != 1 for n, s in zip(shape[:-1], stride[:-1])):
        return t
    strides, step = [], 1
    for size, st in reversed(list(zip(shape, stride))):
        strides.append(step if size == 1 else st)
        step = max(step, size * strides[-1])
    return t.as_strided(t.shape, tuple(reversed(strides)))


def forward(q, k, v, problem: AttentionProblem, cu_seqlens_q=None, cu_seqlens_k=None, tile=None,
            seqused_q=None, seqused_k=None):
    """(out, lse) for validated inputs. `tile` overrides the `config.FwdConfig` for ablations;
    seqused_q/seqused_k: int32 [batch] or None, as `problem` was validated."""
    from flash_cute.jit import current_arch

    from .fwd import HopperFwd

    arch = current_arch()
    if arch != "sm_90a":
        # WGMMA and setmaxnreg exist on sm_90a only; newer GPUs run their own pipeline.
        raise NotImplementedError(f"the hopper pipeline runs on sm_90a only, not {arch}")
    pack = launch.packed_heads(problem, PACK_ROWS, TILES[problem.hdim].tile_m)
    tile = tuple(tile or fwd_tile(problem.hdim, pack, problem.varlen or problem.has_seqused_q,
                                  short_causal(problem.causal, problem.max_seqlen_q * pack,
                                               problem.max_seqlen_k)))
    return launch.forward("hopper.fwd", HopperFwd, q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                          tile, COMPILE_OPTIONS, arch, prepare=_tma_ready, seqused_q=seqused_q,
                          seqused_k=seqused_k, pack_gqa=pack)


def backward(dout, dlse, q, k, v, out, lse, problem: AttentionProblem, cu_seqlens_q=None,
             cu_seqlens_k=None, deterministic: bool = False, tile=None, seqused_q=None,
             seqused_k=None):
    """(dq, dk, dv) through `HopperBwd` (see `flash_cute.launch.backward`); `deterministic`
    makes dQ bitwise reproducible. `tile` overrides the `config.BwdConfig` for ablations."""
    from flash_cute.jit import current_arch

    from .bwd import HopperBwd

    arch = current_arch()
    if arch != "sm_90a":
        raise NotImplementedError(f"the hopper backward runs on sm_90a only, not {arch}")
    launch.check_head_dims("hopper backward", problem, BWD_SUPPORTED_HDIMS)
    tile, dq_layout, options = _bwd_schedule(
        problem.hdim, problem.hdim_v, problem.varlen,
        short_causal(problem.causal, problem.max_seqlen_q, problem.max_seqlen_k,
                     SHORT_CAUSAL_BWD_ROWS),
        None if tile is None else tuple(tile))
    return launch.backward("hopper.bwd", HopperBwd, dout, dlse, q, k, v, out, lse, problem,
                           cu_seqlens_q, cu_seqlens_k, tile, options, arch,
                           prepare=_tma_ready, deterministic=bool(deterministic),
                           dq_accum_align=16, row_stats_align=16, seqused_q=seqused_q,
                           seqused_k=seqused_k, dq_layout=dq_layout)


@functools.lru_cache(maxsize=None)
def _bwd_schedule(hdim: int, hdim_v: int, varlen: bool, short: bool, tile) -> tuple:
    """(tile, dQaccum layout, compile options) of a backward configuration, worked out once:
    the tile (`tile` or the head dim's default, `short`: `config.short_causal`), where the dQ
    tile fits in shared memory the fragment-order dQaccum (`TiledDqAccum`), else None (dQaccum
    laid out like q), and `config.bwd_compile_options`."""
    from .dq_accum import TiledDqAccum

    tile = BwdConfig(*(tile or bwd_tile(hdim, varlen, short)))
    dq_layout = TiledDqAccum.of(tile, hdim) if bwd_smem_plan(hdim, hdim_v, tile).dq_tma else None
    return tuple(tile), dq_layout, bwd_compile_options(tile)
