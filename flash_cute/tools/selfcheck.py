"""`python -m flash_cute check`: on a GPU, a quick correctness check and a short benchmark.

Correctness: the shared blocks' kernels (score attention, LSE merge) and, once an attention
pipeline exists for this GPU, `flash_attn_func`, each against the float64 reference by the
FlashAttention rule. Then two benchmark cells against torch SDPA (cuDNN and flash), with a
plot.
"""

import math
import sys

_SCORE_CASES = (
    # batch, seqlen_q, seqlen_k, causal, window, softcap
    (2, 193, 255, False, (None, None), 0.0),
    (2, 300, 177, True, (None, None), 0.0),
    (1, 250, 250, False, (40, 7), 20.0),
)


def add_arguments(parser):
    parser.add_argument("--no-bench", action="store_true", help="skip the short benchmark")


def _report(name: str, ok: bool, detail: str) -> bool:
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return ok


def check_score_attention() -> bool:
    import torch

    from flash_cute.reference.attention import score_attention_ref, tolerance_check
    from flash_cute.tools.block_kernels import score_attention

    ok = True
    for batch, sq, sk, causal, window, softcap in _SCORE_CASES:
        scores = torch.randn(batch, sq, sk, device="cuda") * 4
        v = torch.randn(batch, sk, 16, device="cuda", dtype=torch.bfloat16)
        out, lse = score_attention(scores, v, 0.3, causal, window, softcap)
        out_ref, lse_ref = score_attention_ref(scores, v, 0.3, causal, window, softcap, "float64")
        native, _ = score_attention_ref(scores, v, 0.3, causal, window, softcap, "native")
        res_o = tolerance_check(out, out_ref, native)
        res_l = tolerance_check(lse, lse_ref, lse_ref.float(), atol=1e-4)
        name = (f"blocks.softmax_rows b{batch} {sq}x{sk} causal={causal} window={window} "
                f"softcap={softcap}")
        ok &= _report(name, res_o.ok and res_l.ok,
                      f"O err {res_o.err:.2e} (native {res_o.err_native:.2e}), "
                      f"LSE err {res_l.err:.2e}")
    return ok


def check_lse_merge() -> bool:
    import torch

    from flash_cute.reference.block_models import lse_merge as lse_merge_model
    from flash_cute.runtime.lse_merge import lse_merge

    o_parts = torch.randn(3, 777, 128, device="cuda")
    lse_parts = torch.randn(3, 777, device="cuda") * 3
    lse_parts[1, ::5] = -math.inf
    out, lse = lse_merge(o_parts, lse_parts, out_dtype=torch.float32)
    out_ref, lse_ref = lse_merge_model(o_parts.double(), lse_parts.double())
    err = max((out.double() - out_ref).abs().max().item(),
              (lse.double() - lse_ref).abs().max().item())
    return _report("blocks.lse_merge 3 splits x 777 rows x 128", err < 1e-4, f"max err {err:.2e}")


def check_attention() -> bool:
    import torch

    import flash_cute
    from flash_cute.reference.attention import attention_ref, tolerance_check

    attn = getattr(flash_cute, "flash_attn_func", None)
    if attn is None:
        print("  --   flash_attn_func: no attention pipeline is built yet")
        return True
    ok = True
    for causal in (False, True):
        q = torch.randn(2, 257, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 301, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 301, 2, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = attn(q, k, v, causal=causal, return_lse=True)
        out_ref, lse_ref = attention_ref(q, k, v, causal=causal, mode="float64")
        native, lse_native = attention_ref(q, k, v, causal=causal, mode="native")
        res = tolerance_check(out, out_ref, native)
        res_lse = tolerance_check(lse, lse_ref, lse_native, atol=1e-4)
        ok &= _report(f"flash_attn_func GQA 4:1 257x301 d128 causal={causal}",
                      res.ok and res_lse.ok,
                      f"O err {res.err:.2e} (native {res.err_native:.2e}), "
                      f"LSE err {res_lse.err:.2e}")
    return ok


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("check needs a CUDA GPU; use `python -m flash_cute inspect` on a CPU-only machine",
              file=sys.stderr)
        return 2
    from flash_cute.tools.support_matrix import device_summary

    print(f"flash_cute check on {torch.cuda.get_device_name()}")
    print(device_summary(torch.cuda.get_device_capability()[0]))
    torch.manual_seed(0)
    ok = check_score_attention() & check_lse_merge() & check_attention()
    if not ok:
        print("correctness check FAILED", file=sys.stderr)
        return 1
    if args.no_bench:
        return 0
    from flash_cute.tools.bench import cli as bench

    # torch's own backends only: FA4 compiles its kernels on every run (its disk cache is
    # opt-in), which would make this quick check slow; `bench` times it.
    bench_args = bench.add_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--hdim", "128", "--seqlen", "4096", "--direction", "fwd",
         "--providers", "flash_cute,sdpa_cudnn,sdpa_flash", "--warmup", "10", "--rep", "40"]
    )
    code = bench.run(bench_args)
    print("FA4 and the full grid: `python -m flash_cute bench [--quick]`; host time per call: "
          "`python -m flash_cute bench latency`")
    return code
