"""The Hopper forward's schedules (FA3's intra-warpgroup overlap and ping-pong, each on and off;
the persistent tile scheduler) against float64 by the FlashAttention rule. The default schedule
runs the whole feature matrix in tests/test_attention_gpu.py; here every other schedule sees
the cases that stress it: one K/V block (no loop body), many blocks, masked rows with no key,
causal and local block skipping, varlen; and the persistent one many more tiles than CTAs
(K/V ring states and ping-pong turns carried across tiles, the next tile's Q loaded under the
epilogue, O's shared tile aliasing Q at hdim 192/256), with outputs poisoned beforehand so that
a tile the scheduler skips shows, and bitwise against one CTA per tile. Needs an H100/H200.
"""

import pytest
import torch
from attention_checks import check_forward

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.runtime import launch_fwd
from flash_cute.runtime.problem import validate_attention_inputs

pytestmark = pytest.mark.gpu

SCHEDULES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.fixture(autouse=True)
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper forward needs an sm90 GPU")


def _tile(d, overlap, pingpong, persistent):
    """The head dim's schedule with the switches set (`config.with_switches`)."""
    from flash_cute.arch.hopper.config import FWD_SCHEDULES, with_switches

    return with_switches(FWD_SCHEDULES[d], intra_wg_overlap=overlap, pingpong=pingpong,
                         persistent=persistent)


def _forward(q, k, v, overlap, pingpong, cu_q=None, cu_k=None, max_q=None, max_k=None,
             persistent=False, **kw):
    from flash_cute.arch.hopper import planner as api

    problem = validate_attention_inputs(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        max_seqlen_q=max_q, max_seqlen_k=max_k, **kw)
    tile = _tile(q.shape[-1], overlap, pingpong, persistent)
    return api.forward(q, k, v, problem, cu_q, cu_k, schedule=tile)


def _inputs(shape_q, shape_k, seed, d=128, dtype=torch.bfloat16, dv=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(*shape_q, d), make(*shape_k, d), make(*shape_k, dv or d)


@pytest.mark.parametrize("overlap,pingpong", SCHEDULES)
@pytest.mark.parametrize("sq,sk,kw", [
    (77, 93, {}),                                 # one K/V block: prologue and epilogue only
    (300, 1000, {"causal": True}),                # every row sees many blocks
    (1000, 300, {"causal": True}),                # first 700 rows see no key
    (513, 777, {"window_size": (100, 50), "softcap": 20.0}),
])
def test_every_schedule_matches_float64(overlap, pingpong, sq, sk, kw):
    q, k, v = _inputs((2, sq, 4), (2, sk, 2), seed=sq + sk)
    out, lse = _forward(q, k, v, overlap, pingpong, **kw)
    check_forward(out, lse, q, k, v, **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(None, 40), (90, None), (250, 0), (0, 0)])
def test_masked_and_unmasked_block_loops(d, window):
    """`HopperFwd.overlapped_blocks`: blocks masked by a right window, unmasked blocks, blocks
    masked by a left window, each in its own loop at 128 rows (hdim 128), or one loop that
    tests at run time at 192 rows (hdim 64); one-sided windows and a diagonal-only one."""
    q, k, v = _inputs((2, 700, 4), (2, 900, 2), seed=sum(w or 0 for w in window) + d, d=d)
    out, lse = _forward(q, k, v, True, True, window_size=window)
    check_forward(out, lse, q, k, v, window_size=window)


@pytest.mark.parametrize("overlap,pingpong", SCHEDULES)
def test_every_schedule_handles_varlen(overlap, pingpong):
    seqlens_q, seqlens_k = [37, 0, 129, 1, 300], [50, 17, 0, 1, 257]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(seqlens_q), cu(seqlens_k)
    q, k, v = _inputs((sum(seqlens_q), 6), (sum(seqlens_k), 2), seed=3)
    out, lse = _forward(q, k, v, overlap, pingpong, cu_q, cu_k, max(seqlens_q), max(seqlens_k),
                        causal=True)
    check_forward(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_schedules_are_separate_compiled_kernels():
    from flash_cute.runtime.jit import compile_cache

    q, k, v = _inputs((1, 100, 2), (1, 100, 2), seed=5)
    before = len(compile_cache)
    outs = [_forward(q, k, v, o, p)[0] for o, p in SCHEDULES]
    assert len(compile_cache) >= before + 1
    for out in outs[1:]:
        # Same math, same order of additions within a row: only the schedule differs.
        assert torch.equal(out, outs[0])


# ---------------------------------------------------------------- persistent tile scheduler


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """O and LSE start as NaN, so every row a kernel leaves unwritten fails the check (the
    varlen cases here have no row outside a sequence, so every row must be written)."""
    from flash_cute.runtime import launch_fwd

    alloc = launch_fwd.ForwardLaunch._alloc

    def poisoned(self):
        out, lse = alloc(self)
        return out.fill_(float("nan")), lse.fill_(float("nan"))

    monkeypatch.setattr(launch_fwd.ForwardLaunch, "_alloc", poisoned)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                        device="cuda")


def _persistent_matches(q, k, v, overlap=True, pingpong=True, **kw):
    """Persistent and one-CTA-per-tile outputs, checked against float64 and, where both
    have the same tile, bitwise equal (same math per tile; only which CTA runs a tile, and
    when, differs)."""
    ref_kw = {n: kw[n] for n in ("causal", "window_size", "softcap") if n in kw}
    if "cu_q" in kw:
        ref_kw.update(cu_seqlens_q=kw["cu_q"], cu_seqlens_k=kw["cu_k"])
    out_p, lse_p = _forward(q, k, v, overlap, pingpong, persistent=True, **kw)
    check_forward(out_p, lse_p, q, k, v, **ref_kw)
    out_1, lse_1 = _forward(q, k, v, overlap, pingpong, persistent=False, **kw)
    check_forward(out_1, lse_1, q, k, v, **ref_kw)
    d = q.shape[-1]
    if _tile(d, overlap, pingpong, True).tile_m == _tile(d, overlap, pingpong, False).tile_m:
        assert torch.equal(out_p, out_1)
        assert torch.equal(lse_p, lse_1)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_runs_many_tiles_per_cta(poisoned_outputs, d, dv, causal):
    """4 x 9 heads x 9 query tiles = 324 tiles > 132 SMs, GQA 9:3, odd lengths; hdim 192/192
    and 256 stage O in Q's shared tile, so the next tile's Q waits for the TMA store."""
    q, k, v = _inputs((4, 1100, 9), (4, 1237, 3), seed=d + causal, d=d, dv=dv)
    _persistent_matches(q, k, v, causal=causal)


@pytest.mark.parametrize("overlap,pingpong", SCHEDULES)
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_every_schedule(poisoned_outputs, d, overlap, pingpong):
    """Ping-pong turns and K/V ring states carried across tiles, with and without each
    overlap; rows that see no key (sq > sk, causal) and tiles that visit no block. hdim 64:
    192-row tiles, the ring of turns over three warpgroups."""
    q, k, v = _inputs((3, 1500, 8), (3, 413, 2), seed=11, d=d)
    _persistent_matches(q, k, v, overlap, pingpong, causal=True)


@pytest.mark.parametrize("d", [128, 256])
def test_persistent_local_softcap(poisoned_outputs, d):
    q, k, v = _inputs((2, 2049, 16), (2, 1999, 4), seed=13, d=d)
    _persistent_matches(q, k, v, window_size=(300, 77), softcap=15.0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_varlen(poisoned_outputs, d, causal):
    """Tiles from max_seqlen_q: most sequences are shorter, so many tiles are skipped by
    every role alike; empty and one-row sequences, 12 heads on 4 KV heads."""
    seqlens_q = [1, 0, 513, 77, 1024, 300, 2, 129, 900, 1000, 5, 640]
    seqlens_k = [3, 9, 700, 77, 1024, 1, 0, 300, 129, 1100, 7, 641]
    q, k, v = _inputs((sum(seqlens_q), 12), (sum(seqlens_k), 4), seed=17 + d, d=d)
    _persistent_matches(q, k, v, cu_q=_cu(seqlens_q), cu_k=_cu(seqlens_k),
                        max_q=max(seqlens_q), max_k=max(seqlens_k), causal=causal)


def test_persistent_with_fewer_tiles_than_sms(poisoned_outputs):
    """One tile per CTA (grid = tiles): no folding, no second tile."""
    q, k, v = _inputs((1, 300, 2), (1, 300, 1), seed=19)
    _persistent_matches(q, k, v, causal=True)


def test_tma_store_clips_rows_past_seqlen_q(poisoned_outputs):
    """Padded O through the TMA store: a last tile of 5 rows must not spill into the next
    batch's rows (checked against float64 over all of O)."""
    q, k, v = _inputs((3, 133, 4), (3, 200, 4), seed=23)
    out, lse = _forward(q, k, v, True, True)
    check_forward(out, lse, q, k, v)


# ---------------------------------------------------------------- packed GQA


def _packed(monkeypatch, q, k, v, **kw):
    """flash_attn_varlen_func with pack_gqa=True on the hopper pipeline; checks that this
    launch packed the whole group into its tiles."""
    from flash_cute.api import interface

    seen = []
    real = launch_fwd.ForwardLaunch

    class Spy(real):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("pack_gqa"))
            super().__init__(*args, **kwargs)

    interface.clear_plans()
    monkeypatch.setattr(launch_fwd, "ForwardLaunch", Spy)
    out, lse = flash_attn_varlen_func(q, k, v, return_lse=True, arch="hopper", pack_gqa=True,
                                      **kw)
    monkeypatch.setattr(launch_fwd, "ForwardLaunch", real)
    assert seen == [q.shape[-2] // k.shape[-2]], seen
    return out, lse


@pytest.mark.parametrize("d,dv,h,hk,sq,sk,kw", [
    (128, 128, 32, 2, 1, 1000, {"causal": True}),         # decode: 16 heads fill 16 rows
    (128, 128, 8, 2, 77, 93, {}),                         # one K/V block, partial tile
    (128, 128, 16, 4, 300, 1000, {"causal": True}),       # many blocks, persistent
    (128, 128, 8, 4, 1000, 300, {"causal": True}),        # rows that see no key
    (64, 64, 16, 2, 300, 513, {"window_size": (100, 50), "softcap": 20.0}),
    (256, 256, 4, 2, 133, 200, {"causal": True}),         # O's tile is Q's
    (192, 128, 8, 1, 45, 301, {}),                        # MQA, hdim_v < hdim
    (96, 96, 64, 1, 3, 129, {"causal": True}),            # a 128-row tile of 64 heads
])
def test_packed_gqa_matches_float64(poisoned_outputs, monkeypatch, d, dv, h, hk, sq, sk, kw):
    """Outputs poisoned with NaN: a packed row left unwritten, or written to another head's
    place, shows."""
    q, k, v = _inputs((2, sq, h), (2, sk, hk), seed=sq + h, d=d, dv=dv)
    out, lse = _packed(monkeypatch, q, k, v, **kw)
    check_forward(out, lse, q, k, v, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_gqa_varlen(poisoned_outputs, monkeypatch, causal):
    """Packed rows of each sequence start at cu_seqlens[b] x group; empty and one-row
    sequences; a tile's rows past its sequence are the next sequence's and stay as written."""
    seqlens_q, seqlens_k = [1, 0, 513, 77, 300, 2, 129], [3, 9, 700, 77, 1, 0, 300]
    q, k, v = _inputs((sum(seqlens_q), 16), (sum(seqlens_k), 4), seed=29, d=64)
    cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
    out, lse = _packed(monkeypatch, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=513, max_seqlen_k=700, causal=causal,
                       window_size=(200, None))
    check_forward(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
           window_size=(200, None))


@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_packed_gqa_seqused(monkeypatch, layout):
    """seqused_q/seqused_k with packed rows: rows past seqused_q keep O = 0 and LSE = -inf;
    NaN in the unused rows of q, k and v must not reach any output."""
    spans_q, spans_k, used_q, used_k = [37, 64, 129], [50, 200, 77], [30, 0, 129], [50, 133, 1]
    if layout == "padded":
        spans_q, spans_k = [129] * 3, [200] * 3
    used = lambda u: torch.tensor(u, dtype=torch.int32, device="cuda")  # noqa: E731
    lead_q = (sum(spans_q),) if layout == "varlen" else (3, spans_q[0])
    lead_k = (sum(spans_k),) if layout == "varlen" else (3, spans_k[0])
    q, k, v = _inputs((*lead_q, 8), (*lead_k, 2), seed=31)
    unused_q = torch.cat([torch.arange(s, device="cuda") >= u for s, u in zip(spans_q, used_q)])
    unused_k = torch.cat([torch.arange(s, device="cuda") >= u for s, u in zip(spans_k, used_k)])
    if layout == "padded":
        unused_q, unused_k = unused_q.view(3, -1), unused_k.view(3, -1)
    q[unused_q], k[unused_k], v[unused_k] = float("nan"), float("nan"), float("nan")
    kw = dict(seqused_q=used(used_q), seqused_k=used(used_k), causal=True)
    lengths = {}
    if layout == "varlen":
        lengths = dict(cu_seqlens_q=_cu(spans_q), cu_seqlens_k=_cu(spans_k))
    out, lse = _packed(monkeypatch, q, k, v, max_seqlen_q=max(used_q) if lengths else None,
                       max_seqlen_k=max(used_k) if lengths else None, **lengths, **kw)
    lse_rows = lse.transpose(0, 1) if layout == "varlen" else lse.transpose(1, 2)
    assert (out[unused_q] == 0).all() and torch.isneginf(lse_rows[unused_q]).all()
    check_forward(out, lse, q, k, v, **lengths, **kw)


def test_pack_gqa_requests():
    """None packs where it fills tiles better (decode), not for long prompts; True with a
    group that does not divide 128 rows, or on a pipeline without packing, is refused."""
    from flash_cute.runtime import launch

    q, k, v = _inputs((1, 1, 12), (1, 64, 3), seed=37)
    problem = validate_attention_inputs(q, k, v)
    assert launch.packed_heads(problem, 128) == 4
    long = validate_attention_inputs(*_inputs((1, 1024, 12), (1, 64, 3), seed=37))
    assert launch.packed_heads(long, 128) == 1
    q3, k3, v3 = _inputs((1, 5, 6), (1, 64, 2), seed=37)
    with pytest.raises(NotImplementedError, match="do not divide the tile's 128 rows"):
        flash_attn_func(q3, k3, v3, arch="hopper", pack_gqa=True)
    with pytest.raises(NotImplementedError, match="pack_gqa=True: not supported by the ampere"):
        flash_attn_func(q, k, v, arch="ampere", pack_gqa=True)
    # Unpackable group with the default: runs unpacked.
    out, lse = flash_attn_func(q3, k3, v3, arch="hopper", return_lse=True)
    check_forward(out, lse, q3, k3, v3)
