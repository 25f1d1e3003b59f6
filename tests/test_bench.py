"""CPU tests of `flash_cute.tools.bench`: the pure parts directly, the device parts on tiny
CPU tensors with a fake timer (torch's CPU SDPA has a flash backend but no cuDNN one)."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import flash_cute
from flash_cute.tools import bench


def parse(argv):
    return bench.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def cell(direction="fwd", hdim=64, causal=False, batch=2, seqlen=1024, nheads=None):
    return bench.BenchConfig(direction, hdim, causal, batch, seqlen,
                             nheads or bench.MODEL_DIM // hdim)


def record(provider, status="ok", ms=1.0, diff=0.0, reason=None, **kw):
    return bench.make_record(cell(**kw), provider, status, ms=ms if status == "ok" else None,
                             max_abs_diff=diff, reason=reason)


# ------------------------------------------------------------------------ flops

def test_flops_hand_computed():
    # 4 * 2 * 16 * 1024 * 1024 * 64 = 2**33
    assert bench.attention_flops(2, 16, 1024, 1024, 64) == 8_589_934_592
    assert bench.attention_flops(2, 16, 1024, 1024, 64, causal=True) == 4_294_967_296
    assert bench.attention_flops(2, 16, 1024, 1024, 64, direction="bwd") == 21_474_836_480
    assert bench.attention_flops(2, 16, 1024, 1024, 64, causal=True,
                                 direction="bwd") == 10_737_418_240


def test_flops_hdim_v_and_uneven_causal():
    # 2 * 1 * 1 * 2 * 3 * (4 + 8)
    assert bench.attention_flops(1, 1, 2, 3, 4, hdim_v=8) == 144
    assert bench.attention_flops(1, 1, 2, 3, 4, hdim_v=4) == bench.attention_flops(1, 1, 2, 3, 4)
    # sq != sk causal: standard halving anyway, 4 * 128 * 256 * 64 / 2
    assert bench.attention_flops(1, 1, 128, 256, 64, causal=True) == 4_194_304


def test_flops_rejects_unknown_direction():
    with pytest.raises(ValueError):
        bench.attention_flops(1, 1, 1, 1, 64, direction="both")


def test_tflops_units():
    # 1e12 FLOPs in 1000 ms is 1 TFLOP/s
    assert bench.tflops_per_s(1e12, 1000.0) == pytest.approx(1.0)
    r = record("sdpa_flash", ms=2.0)  # b=2, h=32, s=1024, d=64: 4*2*32*1024*1024*64 = 2**34
    assert r["flops"] == 17_179_869_184
    assert r["tflops"] == pytest.approx(17_179_869_184 / 2e-3 / 1e12)


# ------------------------------------------------------------------------- grid

def test_full_grid():
    grid = bench.make_grid()
    assert len(grid) == 3 * 6 * 2 * 2 == 72
    assert len(set(grid)) == 72
    assert all(c.nheads * c.hdim == 2048 for c in grid)
    assert {c.hdim for c in grid} == {64, 128, 256}
    assert {(c.batch, c.seqlen) for c in grid} == set(bench.SIZES)
    assert {c.direction for c in grid} == {"fwd", "bwd"}
    assert {c.causal for c in grid} == {False, True}


def test_quick_grid_is_subset():
    quick = bench.make_grid(quick=True)
    assert set(quick) < set(bench.make_grid())
    assert len(quick) == 2 * 2 * 2 * 2
    assert {c.causal for c in quick} == {False, True}
    assert {c.direction for c in quick} == {"fwd", "bwd"}


def test_filters():
    grid = bench.make_grid()
    only = bench.filter_grid(grid, hdims=[128], seqlens=[2048, 8192], causal="1",
                             direction="bwd")
    assert len(only) == 2
    assert all(c.hdim == 128 and c.causal and c.direction == "bwd" for c in only)
    assert {c.seqlen for c in only} == {2048, 8192}
    assert len(bench.filter_grid(grid, causal="0")) == 36
    assert len(bench.filter_grid(grid, direction="fwd")) == 36
    assert bench.filter_grid(grid) == grid
    assert bench.filter_grid(grid, hdims=[96]) == []


# ---------------------------------------------------------------- records, table

def test_wrong_flag_and_nan():
    assert not bench.is_wrong(None)
    assert not bench.is_wrong(0.01)
    assert bench.is_wrong(0.06)
    assert bench.is_wrong(float("nan"))


def test_classify_error():
    assert bench.classify_error(NotImplementedError("hdim 256 bwd"))[0] == "unavailable"
    assert bench.classify_error(bench.Unavailable("x")) == ("unavailable", "x")
    assert bench.classify_error(torch.OutOfMemoryError("CUDA out of memory. Tried"))[1] \
        == "out of memory"
    assert bench.classify_error(RuntimeError("No available kernel. Aborting execution."))[0] \
        == "unavailable"
    status, reason = bench.classify_error(ValueError("bad stride"))
    assert status == "error" and reason == "ValueError: bad stride"


def fake_results():
    rows = []
    for seqlen, batch in ((1024, 16), (2048, 8)):
        for causal in (False, True):
            kw = dict(seqlen=seqlen, batch=batch, causal=causal)
            rows.append(record("flash_cute", ms=1.0, **kw))
            rows.append(record("fa4", status="unavailable",
                               reason="flash_attn.cute not importable", **kw))
            rows.append(record("sdpa_cudnn", ms=1.25, diff=0.2, **kw))  # fast but WRONG
            rows.append(record("sdpa_flash", ms=2.0, **kw))
    rows.append(record("sdpa_flash", ms=4.0, direction="bwd", hdim=128, seqlen=1024, batch=16))
    rows.append(record("flash_cute", status="error", reason="RuntimeError: boom",
                       direction="bwd", hdim=128, seqlen=1024, batch=16))
    return rows


def test_table_columns_and_marks():
    env = {"gpu": "NVIDIA H200", "capability": "90", "torch": "2.13", "triton": "3.5",
           "cutlass-dsl": "4.8.1", "flash-attn": None, "date": "2026-01-01", "dtype": "bf16"}
    text = bench.format_table(fake_results(), list(bench.PROVIDERS), env)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| dir"))
    for name in bench.PROVIDERS:
        assert name in header
    assert bench.RATIO_COLUMN in header
    assert "NVIDIA H200" in text and "cutlass-dsl 4.8.1" in text and "2026-01-01" in text
    rows = [line for line in lines if line.startswith("|")][2:]
    assert len(rows) == 5  # 4 fwd cells + 1 bwd cell
    assert rows[0].split("|")[1].strip() == "fwd"  # fwd before bwd
    first = [c.strip() for c in rows[0].split("|")[1:-1]]
    flops = bench.attention_flops(16, 32, 1024, 1024, 64)
    assert first[5] == f"{flops / 1e-3 / 1e12:.1f}"
    assert first[6] == "n/a"
    assert first[7].endswith("WRONG")
    # the WRONG cudnn cell is not a valid peer: ratio is against sdpa_flash (2 ms / 1 ms)
    assert first[9] == "-"   # sdpa_flash_cute: no record
    assert first[10] == "2.00x"
    bwd = [c.strip() for c in rows[-1].split("|")[1:-1]]
    assert bwd[0] == "bwd" and bwd[5] == "ERR" and bwd[6] == "-" and bwd[9] == "-"
    assert "n/a fa4 (4 cells): flash_attn.cute not importable" in text
    assert "ERR flash_cute (1 cell): RuntimeError: boom" in text


def test_table_without_flash_cute_has_no_ratio():
    results = [r for r in fake_results() if r["provider"] != "flash_cute"]
    text = bench.format_table(results, ["sdpa_cudnn", "sdpa_flash"])
    assert bench.RATIO_COLUMN not in text
    assert "flash_cute" not in text


def test_report_is_strict_json(tmp_path):
    results = fake_results() + [record("fa4", diff=float("nan"))]
    report = bench.build_report(results, {"gpu": "x"}, {"dtype": "bf16"})
    path = tmp_path / "bench.json"
    bench.write_json(report, str(path))
    loaded = json.loads(path.read_text())
    assert len(loaded["results"]) == len(results)
    assert loaded["results"][-1]["max_abs_diff"] is None
    assert loaded["results"][-1]["wrong"] is True
    for key in ("ms", "tflops", "max_abs_diff", "hdim", "nheads", "provider", "status"):
        assert key in loaded["results"][0]


def test_plot_writes_png(tmp_path):
    path = bench.plot_results(fake_results(), str(tmp_path / "bench.png"), title="test")
    data = (tmp_path / "bench.png").read_bytes()
    assert path.endswith("bench.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# --------------------------------------------------------------------------- CLI

def test_argument_defaults():
    args = parse([])
    assert args.quick is False and args.no_plot is False
    assert args.providers == list(bench.PROVIDERS)
    assert (args.causal, args.direction, args.arch, args.dtype) == ("both", "both", "auto", "bf16")
    assert args.out is None and args.warmup == 25 and args.rep == 100
    assert len(bench.selected_configs(args)) == 72


def test_argument_parsing():
    args = parse(["--quick", "--hdim", "64,128", "--seqlen", "2048", "--causal", "1",
                  "--direction", "fwd", "--providers", "flash_cute,sdpa_flash",
                  "--arch", "hopper", "--dtype", "fp16", "--out", "results/x",
                  "--warmup", "5", "--rep", "20", "--no-plot"])
    assert args.hdim == [64, 128] and args.seqlen == [2048]
    assert args.providers == ["flash_cute", "sdpa_flash"]
    assert (args.arch, args.dtype, args.out, args.warmup, args.rep) == ("hopper", "fp16",
                                                                        "results/x", 5, 20)
    assert args.no_plot
    configs = bench.selected_configs(args)
    assert len(configs) == 2
    assert all(c.direction == "fwd" and c.causal and c.seqlen == 2048 for c in configs)


@pytest.mark.parametrize("argv", [["--providers", "xformers"], ["--hdim", "a"],
                                  ["--arch", "volta"], ["--dtype", "fp32"], ["--causal", "2"]])
def test_argument_errors(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_run_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.run(parse(["--quick"])) == 2
    err = capsys.readouterr().err
    assert "bench needs a CUDA GPU" in err and "python -m flash_cute inspect" in err
    assert "Traceback" not in err


def test_run_with_empty_selection(capsys):
    assert bench.run(parse(["--hdim", "96"])) == 2
    assert "no cells match" in capsys.readouterr().err


# -------------------------------------------------- device parts on tiny CPU tensors

TINY = dict(batch=1, seqlen=64, nheads=2, hdim=32)


def fake_timer(fn):
    fn()
    return 0.5


def run_tiny(providers, direction="fwd", causal=True):
    torch.manual_seed(0)
    c = cell(direction=direction, causal=causal, **TINY)
    reference = bench.load_provider("sdpa_flash")
    return {r["provider"]: r for r in bench.run_cell(c, providers, torch.bfloat16, fake_timer,
                                                      device="cpu", reference_provider=reference)}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_cell_on_cpu(direction):
    providers = [bench.load_provider(n) for n in ("sdpa_flash", "sdpa_cudnn")]
    out = run_tiny(providers, direction)
    flash = out["sdpa_flash"]
    assert flash["status"] == "ok" and flash["ms"] == 0.5 and flash["max_abs_diff"] == 0.0
    assert flash["reference"] == "sdpa_flash" and flash["direction"] == direction
    cudnn = out["sdpa_cudnn"]
    assert cudnn["status"] == "unavailable" and cudnn["tflops"] is None


def test_reference_falls_back_to_math():
    q, k, v, _ = bench.make_inputs(cell(**TINY), torch.bfloat16, "cpu")
    ref, name = bench.reference_output(q, k, v, True, bench.load_provider("sdpa_cudnn"))
    assert name == "math_fp32" and ref.dtype == torch.float32 and ref.shape == q.shape
    chunked = bench.math_reference(q, k, v, True, max_bytes=1)  # one head at a time
    assert torch.equal(ref, chunked)
    flash, _ = bench.reference_output(q, k, v, True, bench.load_provider("sdpa_flash"))
    assert bench.max_abs_diff(flash, ref) < 1e-2


def test_inputs_are_random_and_grad_only_for_bwd():
    q, k, v, dout = bench.make_inputs(cell(**TINY), torch.bfloat16, "cpu")
    assert q.shape == (1, 64, 2, 32) and dout is None and not q.requires_grad
    assert q.abs().sum() > 0 and not torch.equal(q, k)
    q, k, v, dout = bench.make_inputs(cell(direction="bwd", **TINY), torch.bfloat16, "cpu")
    assert q.requires_grad and dout.shape == q.shape and not dout.requires_grad


def test_flash_cute_missing_is_unavailable(monkeypatch):
    monkeypatch.delattr(flash_cute, "flash_attn_func", raising=False)
    out = run_tiny([bench.load_provider("flash_cute")])
    assert out["flash_cute"]["status"] == "unavailable"
    assert "flash_attn_func" in out["flash_cute"]["reason"]


def test_flash_cute_not_implemented_is_unavailable(monkeypatch):
    def func(q, k, v, causal=False, arch=None):
        raise NotImplementedError(f"hdim {q.shape[-1]} on {arch}")

    monkeypatch.setattr(flash_cute, "flash_attn_func", func, raising=False)
    out = run_tiny([bench.load_provider("flash_cute", arch="hopper")])
    assert out["flash_cute"]["status"] == "unavailable"
    assert out["flash_cute"]["reason"] == "hdim 32 on hopper"


def test_flash_cute_tuple_result_wrong_and_no_backward(monkeypatch):
    calls = {}

    def func(q, k, v, causal=False, **kwargs):
        calls.update(kwargs)
        return (v.detach() * 0 + 1, None)  # (out, lse) with a wrong out, no autograd graph

    monkeypatch.setattr(flash_cute, "flash_attn_func", func, raising=False)
    fwd = run_tiny([bench.load_provider("flash_cute")])["flash_cute"]
    assert calls == {}  # arch="auto" passes no arch keyword
    assert fwd["status"] == "ok" and fwd["wrong"] and fwd["max_abs_diff"] > 0.5
    bwd = run_tiny([bench.load_provider("flash_cute")], direction="bwd")["flash_cute"]
    assert bwd["status"] == "unavailable" and "grad_fn" in bwd["reason"]
    assert bwd["wrong"]  # the sanity check still ran before the backward was refused


def test_unexpected_exception_is_error(monkeypatch):
    def func(q, k, v, causal=False):
        raise ValueError("bad layout")

    monkeypatch.setattr(flash_cute, "flash_attn_func", func, raising=False)
    out = run_tiny([bench.load_provider("flash_cute")])["flash_cute"]
    assert out["status"] == "error" and out["reason"] == "ValueError: bad layout"


def test_unknown_provider():
    with pytest.raises(ValueError):
        bench.load_provider("xformers")


def test_measuring_loop_on_cpu(tmp_path, capsys, monkeypatch):
    def func(q, k, v, causal=False):
        return (v * 0 + 1, None)  # differentiable but wrong: WRONG flag and exit code 1

    monkeypatch.setattr(flash_cute, "flash_attn_func", func, raising=False)
    args = parse(["--out", str(tmp_path / "run"),
                  "--providers", "flash_cute,sdpa_flash,sdpa_cudnn"])
    configs = [cell(direction=d, causal=True, **TINY) for d in ("fwd", "bwd")]
    assert bench._run_on_gpu(args, configs, fake_timer, device="cpu") == 1
    out = capsys.readouterr()
    assert "| dir" in out.out and "WRONG" in out.out and "n/a" in out.out
    assert "[2/2] bwd hdim=32" in out.err
    report = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert len(report["results"]) == 2 * 3
    assert report["settings"]["providers"] == ["flash_cute", "sdpa_flash", "sdpa_cudnn"]
    assert report["environment"]["torch"] == torch.__version__
    ok = [r for r in report["results"] if r["provider"] == "sdpa_flash"]
    assert all(r["status"] == "ok" and r["ms"] == 0.5 and not r["wrong"] for r in ok)
    assert (tmp_path / "run" / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "run" / "bench.md").read_text().count("| fwd") == 1


def test_bwd_cells_check_the_gradients():
    """A provider whose forward is right but whose backward is not is flagged WRONG."""
    flash = bench.load_provider("sdpa_flash")

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 1.5 * g

    def bad_backward(q, k, v, causal):
        return flash.forward(ScaleGrad.apply(q), k, v, causal)

    bad = bench.Provider("bad_bwd", bad_backward, context=flash.context)
    out = run_tiny([flash, bad], direction="bwd")
    assert out["sdpa_flash"]["grad_rel_diff"] == 0.0 and not out["sdpa_flash"]["wrong"]
    assert out["bad_bwd"]["max_abs_diff"] == 0.0
    assert out["bad_bwd"]["grad_rel_diff"] > 0.3 and out["bad_bwd"]["wrong"]
    assert out["bad_bwd"]["status"] == "ok"


def test_interleaved_times_round_robin_median_and_spread():
    order = []
    ms = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 5.0, 6.0])}

    def fn(name):
        return lambda: name

    def timer(f):
        order.append(f())
        return next(ms[f()])

    out = bench.interleaved_times({"a": fn("a"), "b": fn("b")}, 3, timer)
    assert order == ["a", "b"] * 3
    assert out == {"a": (2.0, 1.0, 3.0), "b": (5.0, 5.0, 6.0)}
    assert bench.spread_pct(out["a"]) == "100.0%"


def test_ablation_rows_skip_missing_entries_and_table_reports_the_spread(capsys):
    ms = iter([2.0, 4.0, 2.0, 4.0])
    rows = bench.ablation_rows((64, 512, 1), {"a": lambda: None, "fa4": None, "b": lambda: None},
                               {"b": "1e-3"}, 2e9, 2, lambda fn: next(ms))
    assert [r[3] for r in rows] == ["a", "b"]
    assert rows[0][4] == 1.0 and rows[1][4] == 0.5 and rows[1][5] == "0.0%"
    assert rows[0][6] == "" and rows[1][6] == "1e-3"
    table = bench.ablation_table(rows, "bwd TFLOP/s", "err")
    assert "round spread" in table and "1e-3" in table
    assert capsys.readouterr().out.count("\n") == 2


def test_tree_ab_table_medians_per_tree_ratio_and_peers():
    """bench/ab_trees.py's table: flash_cute's ms of each process go to its tree, peers pool
    over all processes, failed records are left out, and each tree is compared to the first."""
    def rec(provider, ms, seqlen=1024, status="ok"):
        return {"direction": "fwd", "hdim": 64, "causal": True, "batch": 2, "seqlen": seqlen,
                "provider": provider, "ms": ms, "flops": 2e9, "status": status}

    runs = [("main", [rec("flash_cute", 2.0), rec("fa4", 1.0)]),
            ("wip", [rec("flash_cute", 1.0), rec("fa4", 1.0), rec("flash_cute", 9.0, 2048)]),
            ("main", [rec("flash_cute", 4.0), rec("fa4", 2.0, status="oom")]),
            ("wip", [rec("flash_cute", 1.0), rec("fa4", 1.0)]),
            ("main", [rec("flash_cute", 2.0), rec("fa4", 1.0)]),
            ("wip", [rec("flash_cute", 2.0), rec("fa4", 1.0)])]
    lines = bench.tree_ab_table(runs).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "dir", "hdim", "causal", "batch", "seqlen", "main", "wip", "wip / main", "fa4"]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert cells[0][:5] == ["fwd", "64", "1", "2", "1024"]
    # main: median 2.0 ms (2, 2, 4) -> 1.0 TFLOP/s, spread (4 - 2) / 2; wip: median 1.0 ms.
    assert cells[0][5:9] == ["1.0 (100.0%)", "2.0 (100.0%)", "2.000x", "2.0"]
    # The 2048 cell ran in one tree only.
    assert cells[1][4] == "2048" and cells[1][5] == "—" and cells[1][7] == "—"


def test_ab_trees_peers_once_keeps_every_argument_but_the_providers():
    """bench/ab_trees.py --peers-once: later trees run flash_cute alone, with the same cells."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "ab_trees.py"
    spec = importlib.util.spec_from_file_location("ab_trees", path)
    ab_trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_trees)
    args = ["--direction", "bwd", "--providers", "flash_cute,fa4", "--hdim", "64"]
    parsed = bench.add_arguments(argparse.ArgumentParser()).parse_args(ab_trees.ours_only(args))
    assert parsed.providers == ["flash_cute"]
    assert (parsed.direction, parsed.hdim) == ("bwd", [64])


def _inspect_entry(kernel="hopper.fwd", target="sm_90a", hdim=128, regs=168, hgmma=40):
    return {"kernel": kernel, "arch": target, "registers": regs, "smem_bytes": 1024,
            "spill_bytes": 0, "sass": {"HGMMA.64x128x16.F32.BF16": hgmma, "FFMA": 10},
            "config": {"dtype": "bf16", "hdim": hdim, "hdim_v": hdim, "schedule": [128, 128, 2],
                       "dout_stages": 2}}


def test_sass_diff_names_each_changed_config(tmp_path, capsys):
    """bench/sass_diff.py: identical outputs pass; a changed opcode count, a changed register
    count and a config present on one side only are each named; --rename maps a renamed
    config key."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sass_diff", Path(__file__).resolve().parent.parent / "bench" / "sass_diff.py")
    sass_diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_diff)
    before = [_inspect_entry(), _inspect_entry(hdim=64)]
    renamed = [dict(e, config={("do_stages" if k == "dout_stages" else k): v
                               for k, v in e["config"].items()}) for e in before]
    paths = {}
    for name, entries in [("before", before), ("same", renamed),
                          ("changed", [_inspect_entry(hgmma=41), _inspect_entry(hdim=96)])]:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps([dict(e, target=e.pop("arch")) if name != "before"
                                           else e for e in entries]))
    assert sass_diff.main([str(paths["before"]), str(paths["same"]),
                           "--rename", "dout_stages=do_stages"]) == 0
    assert sass_diff.main([str(paths["before"]), str(paths["same"])]) == 1
    capsys.readouterr()
    assert sass_diff.main([str(paths["before"]), str(paths["changed"])]) == 1
    out = capsys.readouterr().out
    assert "sass.HGMMA.64x128x16.F32.BF16 40 -> 41" in out
    assert '"hdim": 64' in out and '"hdim": 96' in out


def test_latency_table_and_cli_without_a_gpu(capsys):
    """`bench latency` parses with the bench options, refuses to run without CUDA, and its
    table has one row per provider with host, gpu and loop columns per case."""
    from flash_cute import __main__ as cli
    from flash_cute.tools import bench_latency

    if not __import__("torch").cuda.is_available():
        assert cli.main(["bench", "latency", "--calls", "5", "--providers", "flash_cute"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    records = [{"provider": p, "case": c, "host_us": h, "gpu_us": 6.0, "loop_us": h + 1}
               for p, h in (("flash_cute", 25.4), ("fa4", 89.1)) for c in ("fwd", "fwd_bwd")]
    table = bench_latency.format_table(records).splitlines()
    assert table[0].count("host") == 2 and table[2].startswith("| flash_cute | 25.4 | 6.0 | 26.4")
    assert table[3].startswith("| fa4 | 89.1")


def test_fuzz_configs_cover_every_axis_and_stay_supported():
    """bench/fuzz.py's draws (seeded): every axis shows up in 2,000 configs, and each config
    is one the pipeline supports (head dims with a kernel, a backward only where one exists,
    deterministic only on hopper), so a refusal in a fuzz run is a finding, not noise."""
    import importlib.util
    import random
    from pathlib import Path

    from flash_cute.arch.hopper.config import BWD_SUPPORTED_HDIMS, SUPPORTED_HDIMS

    path = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("fuzz", path)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    rng = random.Random(0)
    cfgs = [fuzz.draw(rng, "hopper") for _ in range(2000)]
    axes = {a for cfg in cfgs for a in fuzz._axes(cfg)}
    assert {"varlen", "padded", "causal", "window", "softcap", "bwd det", "group=8",
            "dtype=fp16", "hdim=192/128"} <= axes
    assert all((c["hdim"], c["hdim_v"]) in SUPPORTED_HDIMS for c in cfgs)
    assert all((c["hdim"], c["hdim_v"]) in BWD_SUPPORTED_HDIMS for c in cfgs if c["bwd"])
    assert any(0 in c["lens_q"] for c in cfgs if c["varlen"])  # empty sequences
    assert [fuzz.draw(random.Random(0), "hopper") for _ in range(1)] == cfgs[:1]
    assert all(not c["deterministic"] for c in
               (fuzz.draw(random.Random(1), "ampere") for _ in range(200)))


def test_the_ratio_leaves_out_providers_running_our_kernels():
    """sdpa_flash_cute runs flash-cute's kernels under SDPA: no peer of the ratio."""
    ok = lambda t: {"status": "ok", "tflops": t}  # noqa: E731
    row = {"flash_cute": ok(500.0), "sdpa_flash_cute": ok(600.0), "sdpa_cudnn": ok(400.0)}
    assert bench.flash_cute_ratio(row) == 500.0 / 400.0


def test_sass_text_diff_ignores_symbol_names_only():
    """bench/sass_text_diff.py: a kernel whose class moved (its mangled name spells the module)
    compares equal; a changed instruction does not."""
    spec = importlib.util.spec_from_file_location(
        "sass_text_diff", Path(__file__).resolve().parent.parent / "bench" / "sass_text_diff.py")
    diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diff)
    old = (".text.kernel_cutlass_kernel_flash_cutefwdK_0:\n  CALL `(kernel_cutlass_f_flash_cutefwd_1) ;\n"
           "  FADD R0, R1, R2 ;\n")
    moved = old.replace("flash_cutefwd", "flash_cutearchfwd")
    changed = moved.replace("FADD", "FMUL")
    assert diff.normalised(old) == diff.normalised(moved)
    assert diff.normalised(old) != diff.normalised(changed)


def test_fp8_cells_run_ours_on_e4m3_and_mark_the_others_unavailable():
    """`--dtype e4m3`: forward cells only; inputs quantized per (batch, head), the reference
    run on their dequantized values; flash_cute takes the descales (the CPU runs the FP8
    emulation), within FP8's tolerance, and a provider without an FP8 path is n/a."""
    args = parse(["--dtype", "e4m3", "--quick"])
    assert {c.direction for c in bench.selected_configs(args)} == {"fwd"}
    assert bench.selected_configs(parse(["--dtype", "e4m3", "--direction", "bwd"])) == []
    torch.manual_seed(0)
    c = cell(direction="fwd", causal=True, batch=1, seqlen=64, nheads=2, hdim=64)
    providers = [bench.load_provider(n) for n in ("flash_cute", "sdpa_flash")]
    out = {r["provider"]: r for r in bench.run_cell(
        c, providers, torch.float8_e4m3fn, fake_timer, device="cpu",
        reference_provider=bench.load_provider("sdpa_flash"))}
    ours = out["flash_cute"]
    assert ours["status"] == "ok" and ours["reference"] == "sdpa_flash"
    assert 0 < ours["max_abs_diff"] < 0.1 and not ours["wrong"]
    assert out["sdpa_flash"]["status"] == "unavailable"
    assert out["sdpa_flash"]["reason"] == "no FP8 path"
