"""The Hopper FP8 forward on the CPU: its cross-compiled SASS (QGMMA, no HGMMA, no spill, its
declared pipeline), the index algebra its correctness rests on, checked against CuTe's own
layouts (P's register order against V's transposed key order, the transpose's chunks and
swizzle), and its entry point (the CPU emulation, every bad input refused before a launch)."""

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash_cute.fp8 import quantize_fp8  # noqa: E402
from flash_cute.fp8.attention import flash_attn_fp8  # noqa: E402
from flash_cute.fp8.emulation import emulate  # noqa: E402
from flash_cute.reference.attention import attention_ref  # noqa: E402


def _fp8_configs(labels):
    from flash_cute.tools.registry import CONFIGS

    return [c for c in CONFIGS if c.kernel == "hopper.fwd_fp8" and c.label in labels]


def test_the_fp8_forward_cross_compiles_to_qgmma_without_spills():
    """Both GEMMs on FP8 WGMMA with P from registers, no 16-bit WGMMA, no local memory, V
    transposed by PRMT, and the declared roles (three transpose warps at the producer's
    budget) agree with the SASS's setmaxnreg."""
    from flash_cute.contract.pipeline import from_dict
    from flash_cute.tools.pipelines import check
    from flash_cute.tools.xcompile import cross_compile

    labels = {"e4m3 d128/128 128x128x2+intra_wg_overlap+pingpong causal",
              "e4m3 d256/256 128x64x2+intra_wg_overlap"}
    configs = _fp8_configs(labels)
    assert len(configs) == 2
    for e in cross_compile(configs, targets=["sm_90a"]):
        assert "error" not in e, e.get("error")
        ops = e["sass"]
        assert ops.get("QGMMA", 0) > 0 and ops.get("HGMMA", 0) == 0
        assert e["spill_bytes"] == 0 and ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
        assert ops.get("PRMT", 0) >= 8 and ops.get("MUFU.EX2", 0) > 0
        sass = Path(e["artifacts"]["sass"]).read_text()
        assert all(".E4M3.E4M3" in line for line in sass.splitlines() if "QGMMA" in line)
        # P comes from registers: the PV QGMMAs name a register A operand.
        assert any("QGMMA" in line and ", R" in line.split("QGMMA", 1)[1].split("gdesc")[0]
                   for line in sass.splitlines())
        assert not check(from_dict(e["pipeline"]), sass, e["registers"])
        roles = {r["name"]: r["registers"] for r in e["pipeline"]["roles"]}
        assert roles == {"producer": 40, "transpose": 40, "consumer": 232}


_MMA_LAYOUTS = """
import json, sys
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

tile_n = int(sys.argv[1])
f8 = cutlass.Float8E4M3FN
out = {}


@cute.jit
def trace():
    mma_pv = sm90_utils.make_trivial_tiled_mma(
        f8, f8, OperandMajorMode.K, OperandMajorMode.K, Float32, (2, 1, 1), (64, 128),
        a_source=warpgroup.OperandSource.RMEM)
    mma_qk = sm90_utils.make_trivial_tiled_mma(
        f8, f8, OperandMajorMode.K, OperandMajorMode.K, Float32, (2, 1, 1), (64, tile_n))
    tv_a, tv_c = mma_pv.tv_layout_A_tiled, mma_qk.tv_layout_C_tiled
    frag_a = cute.size(mma_pv.get_slice(0).partition_shape_A((128, tile_n)))
    frag_c = cute.size(mma_qk.get_slice(0).partition_shape_C((128, tile_n)))
    # The tiled layout covers one k-block (K = 32) of A; the fragment holds frag_a / 16.
    out["a"] = [[(tv_a((t, v % 16)) % 128, tv_a((t, v % 16)) // 128 + 32 * (v // 16))
                 for v in range(frag_a)] for t in range(128)]
    out["c"] = [[(tv_c((t, v)) % 128, tv_c((t, v)) // 128) for v in range(frag_c)]
                for t in range(128)]


trace()
print(json.dumps(out))
"""


def _mma_layouts(tile_n: int, folder):
    """Thread-value layouts of the FP8 PV WGMMA's A operand and the QK WGMMA's accumulator,
    evaluated by CuTe at trace time for sm_90a (in a process of its own: the DSL's target is
    fixed at its import): for each of a warpgroup's 128 threads and each value, the (row,
    column) it holds."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    script = folder / "mma_layouts.py"  # the DSL compiles from source files only
    script.write_text(_MMA_LAYOUTS)
    proc = subprocess.run([sys.executable, str(script), str(tile_n)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["a"], out["c"]


@pytest.mark.parametrize("tile_n", [64, 128])
def test_p_in_registers_and_v_transposed_meet_on_the_same_keys(tile_n, tmp_path):
    """For every thread and every byte of P's FP8 A operand: the accumulator value it is
    converted from (`p_sources`) lies on the same row, and its key is the key that V's
    transposed tile holds at that byte's column (`key_order`, π). The A fragment's value order
    (byte, row half, k-half, k-block) is CuTe's, read from its layouts, not assumed."""
    from flash_cute.arch.hopper.fwd_fp8 import key_order, p_sources

    tv_a, tv_c = _mma_layouts(tile_n, tmp_path)
    pi = key_order(tile_n)
    assert sorted(pi) == list(range(tile_n))  # a permutation
    sources = p_sources(len(tv_c[0]))
    assert len(sources) * 4 == len(tv_a[0]) == len(tv_c[0])
    for t in range(128):
        for reg, src in enumerate(sources):
            for byte, c in enumerate(src):
                a_row, a_col = tv_a[t][4 * reg + byte]
                c_row, c_col = tv_c[t][c]
                assert a_row == c_row and pi[a_col] == c_col, (t, reg, byte)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt (default mode): result byte i is byte (sel >> 4i) & 7 of b:a."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    return sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _smem_offsets(hdim_v: int, tile_n: int):
    """Byte offsets (swizzle applied by CuTe) of V's tile as loaded, (d, key, stage 1), and of
    its transpose, (d, a, stage 1), from the kernel's own layouts; each layout's outer
    offsets of stage 0 and of (0, 0, stage 1), and its swizzle parameters."""
    import cutlass.cute as cute

    from flash_cute.arch.hopper.fwd_fp8 import HopperFwdFp8

    kernel = HopperFwdFp8(__import__("cutlass").Float8E4M3FN, 128 if hdim_v <= 128 else 256,
                          hdim_v, schedule=(128, tile_n, 2))
    out = {}

    @cute.jit
    def trace():
        sv, svt = kernel._smem_layouts()[2], kernel._vt_layout()
        for name, layout in (("v", sv), ("vt", svt)):
            sw = layout.inner
            out[name] = ({(d, x): layout((d, x, 1)) for d in range(hdim_v)
                          for x in range(tile_n)},
                         {(d, x): layout.outer((d, x, 0)) for d in range(hdim_v)
                          for x in range(tile_n)},
                         layout.outer((0, 0, 1)),
                         (sw.num_bits, sw.num_base, sw.num_shift))

    trace()
    return out


@pytest.mark.parametrize("hdim_v, tile_n", [
    (128, 224), pytest.param(128, 128, marks=pytest.mark.slow),
    pytest.param(128, 192, marks=pytest.mark.slow), pytest.param(256, 128, marks=pytest.mark.slow),
    pytest.param(256, 64, marks=pytest.mark.slow), pytest.param(64, 128, marks=pytest.mark.slow)])
def test_the_transpose_writes_v_in_the_key_order_of_p(hdim_v, tile_n):
    """A model of `transpose_block` with its own helpers (lane and row coordinates, key
    offsets, PRMT selectors, the hand-applied swizzle) over random bytes laid out by CuTe's
    layouts of V and Vᵀ, in stage 1: each warp's rows, each lane's word found once and XORed
    with the row's; every chunk is visited once, each word so found is CuTe's, and
    Vᵀ(d, a) = V(π(a), d)."""
    from flash_cute.arch.hopper.fwd_fp8 import (
        KEY_OFFSETS,
        TRANSPOSE_WARPS,
        chunk_coords,
        first_key,
        key_order,
        lane_coords,
        swizzled,
        transposed_words,
        warp_coords,
    )

    layouts = _smem_offsets(hdim_v, tile_n)
    for full, outer, stage_off, params in layouts.values():
        assert all(swizzled(outer[k] + stage_off, *params) == full[k] for k in full)

    def word(name, lane_crd, row_crd):  # the kernel's `_Words._index`, stage 1
        _, outer, stage_off, params = layouts[name]
        lane_word, row_word = (swizzled(outer[c], *params) >> 2 for c in (lane_crd, row_crd))
        return 4 * ((lane_word ^ row_word) + (swizzled(stage_off, *params) >> 2))

    v_full, vt_full = layouts["v"][0], layouts["vt"][0]
    rng = random.Random(hdim_v * tile_n)
    size = max(max(v_full.values()), max(vt_full.values())) + 4
    src, dst = bytearray(size), bytearray(size)
    v = {(d, key): rng.randrange(256) for d in range(hdim_v) for key in range(tile_n)}
    for (d, key), byte in v.items():
        src[v_full[(d, key)]] = byte
    load = lambda buf, off: int.from_bytes(buf[off:off + 4], "little")  # noqa: E731
    seen = set()
    rows, v_groups = hdim_v * tile_n // 512, tile_n // 32
    for warp in range(TRANSPOSE_WARPS):
        for w in range(warp, rows, TRANSPOSE_WARPS):
            d_row, v_row = warp_coords(w, v_groups)
            for lane in range(32):
                d_lane, v_lane = lane_coords(lane)
                d0, col = chunk_coords(lane + 32 * w, v_groups)
                assert (d0, col) == (d_lane + d_row, v_lane + v_row)
                seen.add((d0, col))
                key0 = first_key(col)
                assert key0 == first_key(v_lane) + 4 * v_row
                words = []
                for off in KEY_OFFSETS:
                    at = word("v", (d_lane, first_key(v_lane)), (d_row, 4 * v_row + off))
                    assert at == v_full[(d0, key0 + off)]
                    words.append(load(src, at))
                for j, out in enumerate(transposed_words(_prmt, words)):
                    at = word("vt", (d_lane, 4 * v_lane), (d_row + j, 4 * v_row))
                    assert at == vt_full[(d0 + j, 4 * col)]
                    dst[at:at + 4] = out.to_bytes(4, "little")
    assert seen == {(4 * u, col) for u in range(hdim_v // 4) for col in range(tile_n // 4)}
    pi = key_order(tile_n)
    for d in range(hdim_v):
        for a in range(tile_n):
            assert dst[vt_full[(d, a)]] == v[(d, pi[a])], (d, a)


def _quantized(b=2, sq=37, sk=53, h=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    q8, q_desc = quantize_fp8(q.reshape(b, sq, hk, (h // hk) * d), block=None)
    (k8, ks), (v8, vs) = quantize_fp8(k, block=None), quantize_fp8(v, block=None)
    return q8.view(b, sq, h, d), k8, v8, q_desc, ks, vs


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_on_the_cpu_runs_the_kernels_emulation(causal):
    """FA3's descales per (batch, K/V head), GQA: the CPU path is the emulation, and its
    error against float64 of the dequantized inputs is small next to the output."""
    q8, k8, v8, q_desc, ks, vs = _quantized()
    out, lse = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 37, 4, 64)
    qs = q_desc.repeat_interleave(2, dim=1)
    emu, emu_lse = emulate(q8, k8, v8, qs, ks, vs, causal=causal, block=None)
    assert torch.equal(out, emu.to(torch.bfloat16)) and torch.equal(lse, emu_lse)
    deq = (q8.double() * qs.double()[:, None, :, None],
           k8.double() * ks.double()[:, None, :, None],
           v8.double() * vs.double()[:, None, :, None])
    ref, ref_lse = attention_ref(*deq, causal=causal)
    # e4m3 keeps 3 mantissa bits: a few per cent of the output's scale; a wrong scale or
    # descale is off by its whole size.
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.05 * ref.abs().mean()
    assert (lse.double() - ref_lse).abs().max() < 1e-3


def _dequantized(q8, k8, v8, q_desc, ks, vs):
    qs = q_desc.repeat_interleave(q8.shape[-2] // k8.shape[-2], dim=1)
    return tuple(t.double() * s.double()[:, None, :, None]
                 for t, s in ((q8, qs), (k8, ks), (v8, vs)))


def test_fp8_on_the_cpu_takes_windows_softcap_varlen_seqused_and_pages():
    """The emulation path with the kernel's features: each against float64 of the
    dequantized inputs; varlen equal to the padded call sequence by sequence; a paged cache
    equal to the dense one it holds."""
    q8, k8, v8, q_desc, ks, vs = _quantized(b=2, sq=29, sk=64)
    deq = _dequantized(q8, k8, v8, q_desc, ks, vs)
    used = torch.tensor([64, 41], dtype=torch.int32)
    for kw in (dict(window_size=(9, 3)), dict(causal=True, softcap=4.0),
               dict(causal=True, seqused_k=used)):
        out = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, **kw)
        ref, _ = attention_ref(*deq, **kw)
        assert (out.double() - ref).pow(2).mean().sqrt() < 0.05 * ref.abs().mean(), kw
    padded = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, causal=True, seqused_k=used)
    cu_q = torch.tensor([0, 29, 58], dtype=torch.int32)
    cu_k = torch.tensor([0, 64, 128], dtype=torch.int32)
    packed = flash_attn_fp8(q8.flatten(0, 1), k8.flatten(0, 1), v8.flatten(0, 1), q_desc, ks,
                            vs, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=29, max_seqlen_k=64, seqused_k=used)
    assert torch.equal(packed.view_as(padded), padded)
    # The same keys in pages of 16 rows, the table's order shuffled.
    order = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    pages = lambda t: t.reshape(8, 16, *t.shape[2:])[order]  # noqa: E731
    table = torch.argsort(order).view(2, 4).to(torch.int32)
    paged = flash_attn_fp8(q8, pages(k8), pages(v8), q_desc, ks, vs, causal=True,
                           seqused_k=used, page_table=table)
    assert torch.equal(paged, padded)


def test_fp8_bad_input_is_refused_before_any_launch():
    q8, k8, v8, q_desc, ks, vs = _quantized()
    cases = [
        (lambda: flash_attn_fp8(q8, k8.float().to(torch.bfloat16), v8), TypeError, "together"),
        (lambda: flash_attn_fp8(q8, k8, v8, torch.ones(2, 4)), ValueError, "nheads_kv"),
        (lambda: flash_attn_fp8(q8, k8, v8, None, ks.double()), TypeError, "float32"),
        (lambda: flash_attn_fp8(q8, k8, v8, None, None, vs[0]), TypeError, "[batch"),
        (lambda: flash_attn_fp8(q8, k8, v8, out_dtype=torch.float32), TypeError, "out_dtype"),
        (lambda: flash_attn_fp8(q8, k8.float().to(torch.float8_e5m2), v8), TypeError,
         "same dtype"),
        (lambda: flash_attn_fp8(q8[..., :48].contiguous(), k8[..., :48].contiguous(),
                                v8[..., :48].contiguous()), NotImplementedError, "hdim"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=None) as info:
            call()
        assert words in str(info.value), (words, str(info.value))
    with pytest.raises(NotImplementedError, match="bf16"):
        flash_attn_fp8(q8.clone().requires_grad_(), k8, v8)


_FP8_LAUNCH = '''
import torch
import flash_cute.runtime.jit as jit
from flash_cute.arch.hopper import planner
from flash_cute.runtime.problem import validate_attention_inputs

launches = []


class Recording:
    generation = 0

    def get(self, key, build, options=""):
        build()  # the real compile, against fake tensors of the recorded specs
        return lambda *args: launches.append((key, args))


jit.compile_cache = Recording()
q = torch.randn(2, 37, 4, 128).to(torch.float8_e4m3fn)
k, v = (torch.randn(2, 45, 2, 128).to(torch.float8_e4m3fn) for _ in range(2))
problem = problem0 = validate_attention_inputs(q, k, v, causal=True, require_cuda=False,
                                               supported_dtypes=(torch.float8_e4m3fn,))
scales = tuple(torch.rand(2, 2) + 0.5 for _ in range(3))
for out_dtype in (torch.bfloat16, torch.float16):
    launch = planner.plan_forward_fp8(q, k, v, problem, out_dtype=out_dtype)
    out, lse = launch(q, k, v, descales=scales)
    key, args = launches[-1]
    assert key.kernel == "hopper.fwd_fp8" + ("" if out_dtype == torch.bfloat16 else ".fp16")
    assert key.dtype == "e4m3" and key.hdim == 128, key
    assert out.dtype == out_dtype and out.shape == (2, 37, 4, 128) and lse.shape == (2, 4, 37)
    assert args[3] is out and all(a is s for a, s in zip(args[-3:], scales))
# Decode: split-KV over a paged cache of 64-row pages, packed GQA; merged in the kernel (its
# per-stream scratch asks the CUDA runtime for the stream, which a CPU build stubs out).
from flash_cute.runtime.call import paged_view
torch.cuda.is_current_stream_capturing = lambda: False
torch._C._cuda_getCurrentRawStream = lambda index: 0
q1 = torch.randn(2, 1, 8, 128).to(torch.float8_e4m3fn)
cache = [torch.randn(6, 64, 2, 128).to(torch.float8_e4m3fn) for _ in range(2)]
table = torch.arange(6, dtype=torch.int32).view(2, 3)
used = torch.tensor([190, 70], dtype=torch.int32)
kl, vl, _ = paged_view(q1, *cache, (None, None, None, used), table, False)
problem = validate_attention_inputs(q1, kl, vl, seqused_k=used, num_splits=3,
                                    require_cuda=False, supported_dtypes=(torch.float8_e4m3fn,))
launch = planner.plan_forward_fp8(q1, *cache, problem, seqused_k=used, page_table=table)
out, lse = launch(q1, *cache, seqused_k=used, page_table=table, descales=scales)
key, args = launches[-1]
assert dict(key.flags).get("split_kv") and dict(key.flags).get("page") == 64, key
assert args[3].dtype == torch.float32 and args[3].shape[0] == 3  # the splits' partials
assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 8, 128)
# Block scales: rank-3 scales, their own compiled kernel.
blocks = tuple(torch.rand(2, n, h) + 0.5 for n, h in ((1, 4), (1, 2), (1, 2)))
launch = planner.plan_forward_fp8(q, k, v, problem0, out_dtype=torch.bfloat16,
                                  block_scales=True)
out, lse = launch(q, k, v, descales=blocks)
key, args = launches[-1]
assert key.kernel == "hopper.fwd_fp8.block" and all(a is b for a, b in zip(args[-3:], blocks))
print("launched")
'''


@pytest.mark.slow
def test_the_fp8_launch_compiles_and_passes_descales_and_a_16_bit_output():
    """The FP8 forward's host path with the compile cache recording (no GPU): the planner's
    launch compiles the kernel for the call's fake tensors (e4m3 in, bf16 or fp16 out, the
    descales), keys it by the output dtype, allocates O in it and passes the descales last;
    a decode call over a paged cache compiles the split, paged kernel."""
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run([sys.executable, "-c", _FP8_LAUNCH], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stderr[-3000:]


def test_the_public_functions_take_fp8_with_fa3s_keywords():
    """flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache route e4m3 inputs
    with descales to the FP8 forward (the same result as `flash_attn_fp8`), refuse what it
    does not take by name, and refuse descales for 16-bit inputs."""
    import flash_cute

    q8, k8, v8, q_desc, ks, vs = _quantized(b=2, sq=5, sk=64, d=128)
    used = torch.tensor([64, 30], dtype=torch.int32)
    want = flash_attn_fp8(q8, k8, v8, q_desc, ks, vs, causal=True, seqused_k=used)
    out, lse = flash_cute.flash_attn_varlen_func(q8, k8, v8, seqused_k=used, causal=True,
                                                 q_descale=q_desc, k_descale=ks, v_descale=vs,
                                                 return_lse=True)
    assert torch.equal(out, want) and lse.shape == (2, 4, 5)
    cached = flash_cute.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=used, causal=True,
                                               q_descale=q_desc, k_descale=ks, v_descale=vs)
    assert torch.equal(cached, want)
    out16, lse16 = flash_cute.flash_attn_func(q8, k8, v8, q_descale=q_desc, k_descale=ks,
                                              v_descale=vs, out_dtype=torch.float16)
    assert out16.dtype == torch.float16 and lse16 is None
    assert torch.equal(out16, flash_attn_fp8(q8, k8, v8, q_desc, ks, vs,
                                             out_dtype=torch.float16))
    with pytest.raises(NotImplementedError, match="alibi_slopes, dropout_p"):
        flash_cute.flash_attn_func(q8, k8, v8, dropout_p=0.1, alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match="appending"):
        flash_cute.flash_attn_with_kvcache(q8, k8, v8, k=k8[:, :1], v=v8[:, :1],
                                           cache_seqlens=used - 1, k_descale=ks)
    with pytest.raises(ValueError, match="k_descale apply to float8_e4m3fn"):
        flash_cute.flash_attn_func(*(t.float().to(torch.bfloat16) for t in (q8, k8, v8)),
                                   k_descale=ks)


def test_block_scales_run_per_128_tokens_on_the_cpu_and_are_checked():
    """Block scales ([b, blocks, heads], `quantize_fp8`'s) through the public path: the
    emulation with block scales, close to float64 of the block-dequantized inputs; mixed or
    misshapen scales refused."""
    from flash_cute.fp8 import dequantize_fp8

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, n, 64, generator=g) for s, n in ((200, 4), (300, 2), (300, 2)))
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
    assert qs.shape == (2, 2, 4) and ks.shape == (2, 3, 2)
    out = flash_attn_fp8(q8, k8, v8, qs, ks, vs, causal=True)
    assert torch.equal(out, emulate(q8, k8, v8, qs, ks, vs, causal=True)[0].to(out.dtype))
    ref, _ = attention_ref(*(dequantize_fp8(t, sc) for t, sc in ((q8, qs), (k8, ks), (v8, vs))),
                           causal=True)
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.05 * ref.abs().mean()
    with pytest.raises(ValueError, match="not a mix"):
        flash_attn_fp8(q8, k8, v8, qs, ks[:, 0], vs)
    with pytest.raises(ValueError, match=r"k_descale must be \[2, 3, 2\]"):
        flash_attn_fp8(q8, k8, v8, qs, ks[:, :2], vs)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_fp8(q8, k8, v8, qs, ks, vs, softcap=5.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        zeroed = vs.clone()
        zeroed[1, 2, 0] = bad
        with pytest.raises(ValueError, match="v_descale must be positive and finite"):
            flash_attn_fp8(q8, k8, v8, qs, ks, zeroed)


def test_fp8_is_a_capability_that_only_the_hopper_pipeline_has():
    """Dispatch refuses FP8 by name on a pipeline without the FP8 forward, before any launch,
    naming the pipeline that has it."""
    from flash_cute.contract.descriptor import FP8, required_capabilities
    from flash_cute.runtime.dispatch import PIPELINES, check_capabilities
    from flash_cute.runtime.problem import validate_attention_inputs

    q8, k8, v8, *_ = _quantized()
    problem = validate_attention_inputs(q8, k8, v8, require_cuda=False,
                                        supported_dtypes=(torch.float8_e4m3fn,))
    assert FP8 in required_capabilities(problem)
    by_name = {p.name: p for p in PIPELINES}
    check_capabilities(by_name["hopper"], required_capabilities(problem))
    for name in ("ampere", "blackwell"):
        with pytest.raises(NotImplementedError, match="float8_e4m3fn q, k and v.*hopper"):
            check_capabilities(by_name[name], required_capabilities(problem))


def test_the_fp8_operator_passes_opcheck_and_compiles_with_its_output_dtype():
    """``torch.ops.flash_cute.fwd_fp8``: torch.library's opcheck (the fake and real
    implementations agree, also traced with dynamic shapes), and flash_attn_func on e4m3 inputs under torch.compile (fullgraph): the fake
    implementation gives O in out_dtype, and the compiled call equals the eager one."""
    import flash_cute

    q8, k8, v8, q_desc, ks, vs = _quantized(b=1, sq=19, sk=40)
    args = (q8, k8, v8, None, None, None, None, q_desc, ks, vs, None, None, None, True, None,
            None, 0.0, None, 1, None, torch.float16, None)
    # Not "test_schema": its mutation check multiplies the inputs, which torch's CPU build
    # cannot do in float8.
    torch.library.opcheck(torch.ops.flash_cute.fwd_fp8, args,
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))

    def attend(q, k, v, kd, vd):
        return flash_cute.flash_attn_func(q, k, v, causal=True, k_descale=kd, v_descale=vd,
                                          out_dtype=torch.float16)[0]

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = compiled(q8, k8, v8, ks, vs)
    assert out.dtype == torch.float16 and torch.equal(out, attend(q8, k8, v8, ks, vs))


def test_the_fuzz_draws_fp8_configs_and_runs_them(monkeypatch):
    """bench/fuzz.py's FP8 axis on the CPU (where the call and its model are the same
    emulation, so this checks the draw, the quantization, the dequantized reference and
    the comparison run, not the kernel): both kinds of scales, padded and varlen."""
    import random
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    fuzz = __import__("fuzz")
    monkeypatch.setattr(fuzz, "DEVICE", "cpu")
    rng, kinds, ran = random.Random(5), set(), 0
    while ran < 8:
        cfg = fuzz.draw(rng, "hopper")
        if cfg["dtype"] != "e4m3":
            continue
        # Short sequences: the CPU emulation is slow at the fuzz's longest.
        cfg["lens_q"] = [min(n, 129) for n in cfg["lens_q"]]
        cfg["lens_k"] = [min(n, 129) for n in cfg["lens_k"]]
        if not cfg["varlen"]:
            cfg["lens_q"] = [max(cfg["lens_q"])] * len(cfg["lens_q"])
            cfg["lens_k"] = [max(cfg["lens_k"])] * len(cfg["lens_k"])
        assert fuzz.run_config(cfg, ran) == [], cfg
        kinds.add((cfg["scales"], cfg["varlen"]))
        ran += 1
    assert {("block", False), ("head", True)} <= kinds
    sys.modules.pop("fuzz", None)


def test_e5m2_inputs_run_with_an_e4m3_p():
    """float8_e5m2 q, k, v (`quantize_fp8(dtype=...)`): the emulation with P still rounded
    to e4m3, close to float64 of the dequantized inputs; the kernel compiles to QGMMA E5M2 x
    E5M2 for QKᵀ and E4M3 x E5M2 for PV."""
    from flash_cute.tools.xcompile import cross_compile

    g = torch.Generator().manual_seed(4)
    x = [torch.randn(2, s, n, 64, generator=g) for s, n in ((50, 4), (70, 2), (70, 2))]
    (q8, qd), (k8, ks), (v8, vs) = (quantize_fp8(t, block=None, dtype=torch.float8_e5m2)
                                    for t in x)
    assert q8.dtype == torch.float8_e5m2
    qd = qd.view(2, 2, 2)[..., 0].contiguous()     # one per K/V head: a stand-in descale
    out = flash_attn_fp8(q8, k8, v8, qd, ks, vs, causal=True)
    deq = _dequantized(q8, k8, v8, qd, ks, vs)
    ref, _ = attention_ref(*deq, causal=True)
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.1 * ref.abs().mean()
    configs = [c for c in _fp8_configs({"e5m2 d128/128 128x128x2+intra_wg_overlap+pingpong "
                                        "causal"})]
    assert len(configs) == 1
    (e,) = cross_compile(configs, targets=["sm_90a"])
    sass = Path(e["artifacts"]["sass"]).read_text()
    kinds = {line.split()[1] for line in sass.splitlines() if "QGMMA" in line}
    assert kinds == {"QGMMA.64x128x32.F32.E5M2.E5M2", "QGMMA.64x128x32.F32.E4M3.E5M2"}, kinds
    assert e["spill_bytes"] == 0


def test_fp8_host_guards_strides_and_block_scale_tiles():
    """TMA needs 16-byte strides also on FP8's size-1 dims (16 elements, not 8), and block
    scales refuse a tile that straddles their 128-token block."""
    import cutlass

    from flash_cute.arch.hopper.fwd_fp8 import HopperFwdFp8
    from flash_cute.arch.sm90plus.host import tma_ready

    base = torch.zeros(64, 24, dtype=torch.float8_e4m3fn)
    odd = base.as_strided((1, 64, 1, 16), (8, 24, 8, 1))   # size-1 dims with 8-byte strides
    fixed = tma_ready(odd)
    assert all(s % 16 == 0 for n, s in zip(fixed.shape[:-1], fixed.stride()[:-1]) if n == 1)
    # The same strides on a 16-bit tensor are 16 bytes already: left as they are.
    wide = torch.zeros(64, 16, dtype=torch.bfloat16).as_strided((1, 64, 1, 16), (8, 16, 8, 1))
    assert tma_ready(wide) is wide
    with pytest.raises(ValueError, match="dividing their 128-token block"):
        HopperFwdFp8(cutlass.Float8E4M3FN, 128, schedule=(128, 256, 2), block_scales=True)
    HopperFwdFp8(cutlass.Float8E4M3FN, 128, schedule=(128, 64, 2), block_scales=True)


def test_role_budgets_fit_the_ctas_register_pool():
    """Every Hopper kernel's setmaxnreg budgets fit the registers the CTA gets at launch; the
    FP8 forward's (32, 240), which overflows it by 8 a thread-row (the consumers would wait
    forever for registers), is refused before any compile."""
    from flash_cute.arch.hopper import config

    for wgs, budgets in config.ROLE_REGISTERS.items():
        config.check_role_registers(*budgets, wgs, config.CTAS_PER_SM.get(wgs, 1))
    for wgs, budgets in config.PAGED_ROLE_REGISTERS.items():
        config.check_role_registers(*budgets, wgs)
    config.check_role_registers(*config.FP8_ROLE_REGISTERS, 2)
    config.check_role_registers(config.BWD_PRODUCER_REGISTERS, config.BWD_CONSUMER_REGISTERS,
                                config.BWD_CONSUMER_WARPGROUPS)
    with pytest.raises(ValueError, match="exceed"):
        config.check_role_registers(32, 240, 2)
    with pytest.raises(ValueError, match="exceed"):
        config.check_role_registers(24, 240, 1, ctas_per_sm=2)


def test_fp8_output_tiles_borrow_the_vt_ring_only_where_their_own_does_not_fit():
    """O's staging tile (bf16, twice Q's e4m3 size): its own where it fits, else the Vᵀ ring
    when that holds it and the kernel is not persistent (the ring is idle after the last
    block only then); refused otherwise."""
    from flash_cute.arch.hopper.config import fp8_o_tile

    assert fp8_o_tile(128, 128, (128, 128, 2), False, False) == "own"
    assert fp8_o_tile(128, 128, (128, 224, 2), False, False) == "own"
    assert fp8_o_tile(256, 256, (128, 128, 2), False, False) == "vt"
    assert fp8_o_tile(256, 256, (128, 128, 2), True, False) == "none"
    with pytest.raises(ValueError, match="fits neither"):
        fp8_o_tile(256, 256, (128, 128, 2), False, True)
    with pytest.raises(ValueError, match="fits neither"):
        fp8_o_tile(256, 256, (128, 96, 2), False, False)


@pytest.mark.slow
def test_a_wider_fp8_key_tile_cross_compiles_without_spills():
    """FA3's 128 x 224 at hdim 128 (registered for inspect): QGMMA, no spills, O in a tile of
    its own."""
    from flash_cute.arch.hopper.config import fp8_smem_bytes
    from flash_cute.tools.xcompile import cross_compile

    configs = _fp8_configs({"e4m3 d128/128 128x224x2+intra_wg_overlap+pingpong causal"})
    assert len(configs) == 1
    for e in cross_compile(configs, targets=["sm_90a"]):
        assert "error" not in e, e.get("error")
        assert e["sass"].get("QGMMA", 0) > 0 and e["spill_bytes"] == 0
        assert e["smem_bytes"] >= fp8_smem_bytes(128, 128, (128, 224, 2), True)
