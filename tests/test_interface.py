"""Dispatch and API contracts that need no GPU."""

import dataclasses

import pytest
import torch

import flash_cute
from flash_cute import create_block_mask
from flash_cute.arch.ampere import planner as ampere_api
from flash_cute.arch.hopper import planner as hopper_api
from flash_cute.contract.descriptor import required_capabilities
from flash_cute.runtime import call as call_pass
from flash_cute.runtime import dispatch, launch_bwd, launch_fwd, plans
from flash_cute.runtime.dispatch import AMPERE, HOPPER
from flash_cute.runtime.launch import variant_of
from flash_cute.runtime.problem import validate_attention_inputs
from flash_cute.tools.kernel_config import variant_from_flags


def _replace(monkeypatch, pipeline, **changes):
    """Dispatch with `pipeline`'s descriptor changed (e.g. a capability taken away)."""
    changed = dataclasses.replace(pipeline, **changes)
    monkeypatch.setattr(dispatch, "PIPELINES",
                        tuple(changed if p is pipeline else p for p in dispatch.PIPELINES))
    return changed


def test_dispatch_picks_the_newest_pipeline_that_runs_there(capability):
    capability(8, 0)
    assert dispatch.select_pipeline(torch.device("cuda")).name == "ampere"
    capability(9, 0)
    assert dispatch.select_pipeline(torch.device("cuda")).name == "hopper"
    capability(10, 0)  # WGMMA does not exist on sm100: the sm80 code runs there
    assert dispatch.select_pipeline(torch.device("cuda")).name == "ampere"


def test_a_pipeline_not_run_on_hardware_is_opt_in(capability, monkeypatch):
    """A compile-verified pipeline stays out of the default order; arch= still reaches it."""
    capability(9, 0)
    _replace(monkeypatch, HOPPER, hardware_tested=False)
    assert dispatch.select_pipeline(torch.device("cuda")).name == "ampere"
    assert dispatch.select_pipeline(torch.device("cuda"), "hopper").name == "hopper"


def test_arch_override(capability):
    capability(9, 0)
    assert dispatch.select_pipeline(torch.device("cuda"), "ampere") is AMPERE
    with pytest.raises(NotImplementedError, match="no such pipeline"):
        dispatch.select_pipeline(torch.device("cuda"), "volta")


def test_old_gpus_are_refused(capability):
    capability(7, 5)
    with pytest.raises(NotImplementedError, match="7.x"):
        dispatch.select_pipeline(torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on compute capability 8.x"):
        dispatch.select_pipeline(torch.device("cuda"), "ampere")


def test_ampere_supported_head_dims():
    def problem(d, dv):
        q = torch.randn(1, 4, 2, d, dtype=torch.bfloat16)
        v = torch.randn(1, 4, 2, dv, dtype=torch.bfloat16)
        return validate_attention_inputs(q, q, v, require_cuda=False)

    for d, dv in [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)]:
        ampere_api.check_supported(problem(d, dv))
    for d, dv in [(80, 80), (128, 64), (32, 32)]:
        with pytest.raises(NotImplementedError, match="hdim"):
            ampere_api.check_supported(problem(d, dv))


def test_hopper_runs_on_sm90_only(capability):
    capability(9, 0)
    assert dispatch.select_pipeline(torch.device("cuda"), "hopper") is HOPPER
    for major in (8, 10):
        capability(major, 0)
        with pytest.raises(ValueError, match="runs on compute capability 9.x"):
            dispatch.select_pipeline(torch.device("cuda"), "hopper")


def test_backward_runs_in_the_forward_pipeline(capability):
    capability(9, 0)
    assert dispatch.select_backward_pipeline(torch.device("cuda"), HOPPER) is HOPPER
    assert dispatch.select_backward_pipeline(torch.device("cuda"), AMPERE) is AMPERE


def test_backward_falls_back_to_a_pipeline_that_has_one(capability, monkeypatch):
    capability(9, 0)
    forward_only = _replace(monkeypatch, HOPPER, plan_backward=None,
                            capabilities=HOPPER.capabilities - {"backward"})
    assert dispatch.select_backward_pipeline(torch.device("cuda"), forward_only) is AMPERE


def test_deterministic_backward_is_refused_by_name_where_dq_uses_atomics(capability):
    capability(9, 0)
    problem = validate_attention_inputs(*(torch.randn(1, 8, 2, 64, dtype=torch.bfloat16),) * 3,
                                        require_cuda=False)
    assert dispatch.select_backward_pipeline(torch.device("cuda"), HOPPER, problem,
                                             deterministic=True) is HOPPER
    with pytest.raises(NotImplementedError, match="deterministic=True: not supported by the "
                                                  "ampere pipeline yet; pipelines that "
                                                  "support it: blackwell, hopper"):
        dispatch.select_backward_pipeline(torch.device("cuda"), AMPERE, problem,
                                          deterministic=True)


def test_hopper_supported_head_dims():
    def problem(d, dv):
        q = torch.randn(1, 4, 2, d, dtype=torch.bfloat16)
        v = torch.randn(1, 4, 2, dv, dtype=torch.bfloat16)
        return validate_attention_inputs(q, q, v, require_cuda=False)

    for d, dv in [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)]:
        hopper_api.check_supported(problem(d, dv))
    for d, dv in [(80, 80), (128, 64), (32, 32)]:
        with pytest.raises(NotImplementedError, match="hopper pipeline has no kernel"):
            hopper_api.check_supported(problem(d, dv))
    for d, dv in [(64, 64), (128, 128), (256, 256), (192, 128)]:
        hopper_api.check_supported(problem(d, dv), backward=True)


def test_tma_strides_of_size_one_dims_are_made_compact():
    from flash_cute.arch.sm90plus.host import tma_ready

    x = torch.randn(7, 3, 64).unsqueeze(0).as_strided((1, 7, 3, 64), (5, 192, 64, 1))
    y = tma_ready(x)
    assert y.stride() == (1344, 192, 64, 1) and torch.equal(x, y)
    z = torch.randn(2, 7, 3, 64)
    assert tma_ready(z) is z


def test_cpu_tensors_run_the_reference_and_refuse_a_gpu_arch():
    """CPU inputs run the operators' CPU implementation (the float32 reference); asking
    for a GPU pipeline with them is an error, not a silent fallback."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    out, lse = flash_cute.flash_attn_func(q, q, q, return_lse=True)
    ref, ref_lse = flash_cute.attention_ref(q, q, q, mode="float32")
    assert out.dtype == q.dtype and torch.equal(out, ref.to(q.dtype))
    assert torch.equal(lse, ref_lse)
    with pytest.raises(ValueError, match="arch='hopper' picks a GPU pipeline"):
        flash_cute.flash_attn_func(q, q, q, arch="hopper")


# flash_attn.cute's parameter lists in flash-attn 4.0.0b36 (the GPU bundle's), with their
# defaults, written out: the drop-in claim is checked against them, name, order and default.
_FA4_FUNC = [
    ("q", None), ("k", None), ("v", None), ("qv", None), ("gather_kv_indices", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (None, None)),
    ("learnable_sink", None), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
    ("deterministic", False), ("score_mod", None), ("score_mod_bwd", None), ("mask_mod", None),
    ("aux_tensors", None), ("aux_scalars", None), ("block_sparse_tensors", None),
    ("block_sparse_tensors_bwd", None), ("return_lse", False), ("gather_bwd_recompute_p", False),
    ("gather_bwd_token_chunk", None)]
_FA4_VARLEN = [
    ("q", None), ("k", None), ("v", None), ("qv", None), ("cu_seqlens_q", None),
    ("cu_seqlens_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None),
    ("min_seqlen_k", None), ("seqused_q", None), ("seqused_k", None),
    ("gather_kv_indices", None), ("page_table", None), ("softmax_scale", None),
    ("causal", False), ("window_size", (None, None)), ("learnable_sink", None),
    ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
    ("score_mod", None), ("score_mod_bwd", None), ("mask_mod", None),
    ("block_sparse_tensors", None), ("aux_tensors", None), ("aux_scalars", None),
    ("return_lse", False), ("scheduler_metadata", None), ("seqlen_k_per_split", None),
    ("disable_scheduler_metadata", False), ("gather_bwd_recompute_p", False),
    ("gather_bwd_token_chunk", None)]


@pytest.mark.parametrize("fn,fa4", [(flash_cute.flash_attn_func, _FA4_FUNC),
                                    (flash_cute.flash_attn_varlen_func, _FA4_VARLEN)])
def test_api_signature_matches_flash_attn_cute(fn, fa4):
    """FA4's parameters, in its order and with its defaults, positional or keyword; then
    flash-cute's own, keyword-only."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    ours = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in params[:len(fa4)]]
    assert ours == fa4
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:len(fa4)])
    fp8 = ["q_descale", "k_descale", "v_descale", "out_dtype"]   # FA3's, and O's dtype
    own = (["arch", "block_mask", "page_table", "alibi_slopes", "dropout_p"]
           if fn is flash_cute.flash_attn_func else ["arch", "alibi_slopes", "dropout_p"]) + fp8
    assert [(p.name, p.kind) for p in params[len(fa4):]] == [
        (name, inspect.Parameter.KEYWORD_ONLY) for name in own]


@pytest.mark.parametrize("name,value", [
    ("qv", torch.zeros(1)), ("gather_kv_indices", torch.zeros(1)),
    ("gather_bwd_recompute_p", True)])
def test_fa4_features_not_built_raise_not_implemented_naming_them(name, value):
    """Before validation or any launch: FA4 code gets NotImplementedError, never TypeError."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=name):
        flash_cute.flash_attn_func(q, q, q, **{name: value})
    with pytest.raises(NotImplementedError, match=name):
        flash_cute.flash_attn_varlen_func(q, q, q, **{name: value})


def test_fa4_block_sparse_tensors_read_as_a_block_mask():
    """FA4's query-major block-sparsity tensors mean what the BlockMask of the same blocks
    means (`block_mask.from_fa4`, its block size given or inferred); varlen has none (as in
    FA4), and anything else is refused by name."""
    from collections import namedtuple

    from flash_cute.variants.block_mask import block_states, from_fa4

    Tensors = namedtuple("Tensors", "mask_block_cnt mask_block_idx full_block_cnt "
                                    "full_block_idx block_size")

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    flex = create_block_mask(causal, 2, 1, 300, 300, device="cpu")
    fa4 = Tensors(flex.kv_num_blocks, flex.kv_indices, flex.full_kv_num_blocks,
                  flex.full_kv_indices, None)
    blocks = from_fa4(fa4, 300, 300)
    assert blocks.BLOCK_SIZE == (128, 128) and blocks is from_fa4(fa4, 300, 300)
    assert torch.equal(block_states(blocks), block_states(flex))
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="block_sparse_tensors"):
        flash_cute.flash_attn_varlen_func(q, q, q, block_sparse_tensors=fa4)
    with pytest.raises(TypeError, match="BlockSparseTensorsTorch"):
        flash_cute.flash_attn_func(q, q, q, block_sparse_tensors=object())
    with pytest.raises(ValueError, match="do not cover"):
        from_fa4(fa4._replace(block_size=(64, 64)), 300, 300)
    # The backward's key-major tensors of the same mask, compact (FA4 reads only the first
    # count entries of each row), give the same states.
    states = block_states(flex)
    by_key = states[0, 0].T
    count = (by_key == 1).sum(-1).to(torch.int32)
    full_count = (by_key == 2).sum(-1).to(torch.int32)
    listed = lambda want: torch.stack([  # noqa: E731
        torch.nn.functional.pad((row == want).nonzero().flatten(), (0, 3))[:2]
        for row in by_key]).to(torch.int32)
    bwd = Tensors(count[None, None], listed(1)[None, None], full_count[None, None],
                  listed(2)[None, None], (128, 128))
    assert torch.equal(block_states(from_fa4(bwd, 300, 300, key_major=True)), states[:1])


@pytest.mark.parametrize("kwargs", [
    dict(score_mod=lambda s, b, h, q, k, seqlen_info, aux: s),
    dict(mask_mod=lambda b, h, q, k, seqlen_info, aux: q >= k),
    dict(score_mod=lambda s, b, h, q, k, seqlen_info, aux: s, aux_tensors=[torch.zeros(2)]),
    dict(score_mod=lambda s, b, h, q, k, seqlen_info, aux, scalars: s, aux_scalars=[2, 0.5])])
def test_fa4_form_mods_are_taken_and_run_in_the_gpu_kernels_only(kwargs):
    """FA4's @cute.jit form (seven / six parameters, one more with aux_scalars) is recognized;
    CPU tensors, which run the reference, refuse it naming the way out."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="GPU kernels only"):
        flash_cute.flash_attn_func(q, q, q, **kwargs)


def test_num_splits_and_scheduling_hints_reach_validation(capability, monkeypatch):
    """num_splits (1, FA4's 'choose' at 0 and below, n > 1) and seqlen_k_per_split reach
    validation as given; min_seqlen_k and disable_scheduler_metadata are accepted hints."""
    capability(9, 0)
    seen = []
    monkeypatch.setattr(call_pass, "validate_attention_inputs",
                        lambda *a, **kw: seen.append(kw) or (_ for _ in ()).throw(ValueError("stop")))
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    for n in (1, 0, 4):
        with pytest.raises(ValueError, match="stop"):
            flash_cute.flash_attn_func(q, q, q, num_splits=n)
    with pytest.raises(ValueError, match="stop"):
        flash_cute.flash_attn_varlen_func(q, q, q, min_seqlen_k=3, disable_scheduler_metadata=True,
                                          num_splits=-1, seqlen_k_per_split=256)
    assert [(kw["num_splits"], kw["seqlen_k_per_split"]) for kw in seen] == [
        (1, None), (0, None), (4, None), (0, 256)]


@pytest.mark.parametrize("kw, error", [
    ({"num_splits": 257}, ValueError), ({"num_splits": 2.0}, TypeError),
    ({"num_splits": True}, TypeError), ({"seqlen_k_per_split": 0}, ValueError),
    ({"seqlen_k_per_split": 128.0}, ValueError)])
def test_bad_split_arguments_are_refused(kw, error):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match="num_splits|seqlen_k_per_split"):
        flash_cute.flash_attn_varlen_func(q, q, q, **kw)


def test_split_request_on_cpu_runs_the_reference():
    """The CPU operator validates the split arguments and computes the unsplit result."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    want, _ = flash_cute.flash_attn_func(q, k, v)
    got, _ = flash_cute.flash_attn_func(q, k, v, num_splits=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_inputs_as_autograd_hands_them_over_pass_validation(varlen):
    """The exact tensors `_FlashAttnFunc.backward` validates: forward outputs and a dout made
    kernel-ready from an expanded gradient (what `out.sum().backward()` produces)."""
    from flash_cute.runtime.problem import validate_backward_inputs

    b, sq, sk, h, hk, d, dv = 2, 37, 53, 8, 2, 192, 128
    if varlen:
        cu_q = torch.tensor([0, 17, 37], dtype=torch.int32)
        cu_k = torch.tensor([0, 20, 53], dtype=torch.int32)
        q, k, v = torch.randn(sq, h, d), torch.randn(sk, hk, d), torch.randn(sk, hk, dv)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=33)
        out, lse = torch.randn(sq, h, dv), torch.randn(h, sq)
    else:
        q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, dv)
        kw = {}
        out, lse = torch.randn(b, sq, h, dv), torch.randn(b, h, sq)
    q, k, v, out = (t.to(torch.bfloat16) for t in (q, k, v, out))
    problem = validate_attention_inputs(q, k, v, causal=True, require_cuda=False, **kw)
    dout = plans.kernel_ready(torch.ones((), dtype=torch.bfloat16).expand(out.shape))
    validate_backward_inputs(dout, q, k, v, out, lse, problem, require_cuda=False)


def test_kernel_ready_makes_gradients_contiguous_and_aligned():
    flat = torch.randn(1 + 4 * 8 * 64, dtype=torch.bfloat16)
    offset = flat[1:].view(4, 8, 64)  # 2-byte offset from an aligned allocation
    assert offset.data_ptr() % 16 != 0
    ready = plans.kernel_ready(offset)
    assert ready.is_contiguous() and ready.data_ptr() % 16 == 0 and torch.equal(ready, offset)
    expanded = torch.ones((), dtype=torch.bfloat16).expand(4, 8, 64)
    assert plans.kernel_ready(expanded).stride() == (512, 64, 1)


def test_ampere_refuses_tiles_larger_than_the_gpus_shared_memory(monkeypatch):
    """sm86/sm89/sm120 give a CTA ~99 KiB: the hdim 256 forward and hdim 128 backward don't fit."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(shared_memory_per_block_optin=101376))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake sm_86")

    def problem(d):
        q = torch.randn(1, 4, 2, d, dtype=torch.bfloat16)
        return validate_attention_inputs(q, q, q, require_cuda=False)

    ampere_api.check_supported(problem(64), "cuda", backward=True)
    ampere_api.check_supported(problem(128), "cuda")
    with pytest.raises(NotImplementedError, match="ampere backward kernel needs"):
        ampere_api.check_supported(problem(128), "cuda", backward=True)
    with pytest.raises(NotImplementedError, match="ampere forward kernel needs"):
        ampere_api.check_supported(problem(256), "cuda")


def test_varlen_is_sent_to_hopper_by_default(capability):
    """The Hopper kernels zero the tile rows past a varlen sequence, so it takes varlen."""
    capability(9, 0)
    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    varlen = validate_attention_inputs(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                                       max_seqlen_k=6, require_cuda=False)
    padded = validate_attention_inputs(q[None], q[None], q[None], require_cuda=False)
    device = torch.device("cuda")
    assert dispatch.select_pipeline(device, None, varlen) is HOPPER
    assert dispatch.select_pipeline(device, None, padded) is HOPPER
    assert dispatch.select_pipeline(device, "hopper", varlen) is HOPPER


def test_every_compile_time_switch_is_in_the_cache_key():
    """Two variants that compile differently never share a CompileKey: every switch a kernel
    reads (set_kernel_switches) is in Variant.flags(), and distinct variants have distinct flags."""
    import dataclasses
    import itertools

    from flash_cute.blocks.score import set_kernel_switches
    from flash_cute.contract.variant import Variant
    from flash_cute.tools.kernel_config import example_spec

    seen = {}
    mods = {"mods": [None, example_spec("alibi"), example_spec("document")]}
    kinds = {int: [1, 4], "int": [1, 4], str: ["", "shift", "frame"],
             "str": ["", "shift", "frame"]}
    choices = [mods.get(f.name) or kinds.get(f.type, [False, True])
               for f in dataclasses.fields(Variant)]
    for values in itertools.product(*choices):
        try:
            variant = Variant(*values)
        except ValueError:   # softcap with a traced score mod: refused
            continue
        kernel = type("K", (), {})()
        set_kernel_switches(kernel, variant)
        switches = tuple(sorted(vars(kernel).items()))
        flags = variant.flags()
        assert seen.setdefault(flags, switches) == switches
    assert len(set(seen.values())) == len(seen)
    # causal + right window is the same kernel as causal alone (right = 0), and says so.
    assert Variant(causal=True, window_right=True).flags() == Variant(causal=True).flags()


def _seqused_problems():
    """(varlen with seqused_q, padded with seqused_k) problems, validated on the CPU."""
    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    varlen = validate_attention_inputs(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                                       max_seqlen_k=6, seqused_q=torch.tensor([3, 6], dtype=torch.int32),
                                       require_cuda=False)
    padded = validate_attention_inputs(q[None], q[None], q[None], require_cuda=False,
                                       seqused_k=torch.tensor([7], dtype=torch.int32))
    return varlen, padded


def test_seqused_goes_to_a_pipeline_that_takes_it(capability, monkeypatch):
    """A pipeline without seqused slots is never the default for them, and refused when forced."""
    capability(9, 0)
    device = torch.device("cuda")
    for problem in _seqused_problems():
        assert dispatch.select_pipeline(device, None, problem) is HOPPER
    without = _replace(monkeypatch, HOPPER, capabilities=HOPPER.capabilities - {"seqused"})
    for problem in _seqused_problems():
        needed = required_capabilities(problem)
        chosen = dispatch.select_pipeline(device, None, problem)
        assert chosen is AMPERE and chosen.missing(needed) is None
        dispatch.check_capabilities(AMPERE, needed)
        with pytest.raises(NotImplementedError, match="seqused_q/seqused_k: not supported by "
                                                      "the hopper pipeline yet; pipelines that "
                                                      "support it: blackwell, ampere"):
            dispatch.check_capabilities(without, needed)


def _gqa_problem(sq, h=8, hk=2, **kw):
    q = torch.randn(1, sq, h, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 40, hk, 64, dtype=torch.bfloat16)
    return validate_attention_inputs(q, k, k, require_cuda=False, **kw)


def test_pack_gqa_request_is_validated_and_dispatched(capability):
    """pack_gqa=True goes only to a pipeline that packs; None and False go anywhere."""
    with pytest.raises(TypeError, match="pack_gqa must be None, True or False"):
        _gqa_problem(3, pack_gqa=1)
    capability(9, 0)
    device = torch.device("cuda")
    forced = _gqa_problem(3, pack_gqa=True)
    needed = required_capabilities(forced)
    assert AMPERE.missing(needed) == "pack_gqa=True"
    assert HOPPER.missing(needed) is None
    with pytest.raises(NotImplementedError, match="pipelines that support it: blackwell, hopper"):
        dispatch.check_capabilities(AMPERE, needed)
    assert dispatch.select_pipeline(device, None, forced) is HOPPER
    # MHA has nothing to pack: any pipeline takes pack_gqa=True.
    assert AMPERE.missing(required_capabilities(_gqa_problem(3, hk=8, pack_gqa=True))) is None
    capability(8, 0)
    for request in (None, False):
        problem = _gqa_problem(3, pack_gqa=request)
        assert dispatch.select_pipeline(device, None, problem) is AMPERE
    # No pipeline here packs: the refusal names the request, not the device.
    with pytest.raises(NotImplementedError, match="pack_gqa=True: not supported by the ampere"):
        dispatch.select_pipeline(device, None, forced)


def test_a_block_mask_the_heads_share_packs_and_one_per_head_does_not():
    """pack_gqa with a block mask (D-PACK-BLOCKS): one shared by the query heads packs, the
    kernel's tiles then hold tile_m / pack queries (nested in 128-row blocks down to 32
    queries a tile); one per head runs unpacked, as FA4's calls do."""
    import dataclasses

    from flash_cute import create_block_mask
    from flash_cute.contract.block_range import tiles_nest
    from flash_cute.runtime import launch
    from flash_cute.variants import registry

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    problem = _gqa_problem(3, pack_gqa=True)
    for heads, packs in ((1, 4), (8, 1)):
        block_mask = create_block_mask(causal, 1, heads, 3, 40, device="cpu")
        mods = registry.lookup(registry.register(None, causal, block_mask))
        assert launch.packed_heads(dataclasses.replace(problem, mods=mods), 128) == packs
    assert tiles_nest((128, 128), 128, 128, 4) and tiles_nest((32, 128), 128, 128, 4)
    assert not tiles_nest((16, 128), 128, 128, 4) and not tiles_nest((64, 128), 128, 128, 1)


def test_packed_heads_decision():
    """FlashAttention-3's rule for None (pack where it fills the tile's rows clearly better,
    varlen by its max_seqlen_q); True needs the group to divide the tile; False and MHA never
    pack."""
    from flash_cute.runtime import launch

    assert launch.packed_heads(_gqa_problem(1), 128) == 4          # decode: 4 rows, not 1
    assert launch.packed_heads(_gqa_problem(40), 128) == 4         # 160/256 vs 40/128
    assert launch.packed_heads(_gqa_problem(100), 128) == 1        # 400/512 = 100/128
    assert launch.packed_heads(_gqa_problem(100), 128, 192) == 4   # 400/576 vs 100/192
    assert launch.packed_heads(_gqa_problem(128), 128) == 1        # full tiles either way
    assert launch.packed_heads(_gqa_problem(1000), 128) == 1       # 1000/1024 vs 4000/4096
    assert launch.packed_heads(_gqa_problem(1, pack_gqa=False), 128) == 1
    assert launch.packed_heads(_gqa_problem(0), 128) == 1          # no rows: no division by 0
    assert launch.packed_heads(_gqa_problem(1000, pack_gqa=True), 128) == 4
    assert launch.packed_heads(_gqa_problem(1, hk=8), 128) == 1
    assert launch.packed_heads(_gqa_problem(1, h=6, hk=2), 128) == 1
    with pytest.raises(NotImplementedError, match="3 query heads per K/V head do not divide"):
        launch.packed_heads(_gqa_problem(1, h=6, hk=2, pack_gqa=True), 128)
    q = torch.randn(10, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    varlen = validate_attention_inputs(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=6, max_seqlen_k=6, require_cuda=False)
    assert launch.packed_heads(varlen, 128) == 4                   # max_seqlen_q 6: decode-like
    long = validate_attention_inputs(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=1000, max_seqlen_k=6, require_cuda=False)
    assert launch.packed_heads(long, 128) == 1                     # varlen is not packed as such


def test_packing_is_part_of_the_compile_key_only_where_it_packs():
    from flash_cute.contract.variant import Variant

    problem = _gqa_problem(1)
    assert variant_of(problem).flags() == Variant().flags()
    packed = variant_of(problem, 4)
    assert ("pack_gqa", 4) in packed.flags()
    assert variant_from_flags(dict(packed.flags())) == packed


def test_backward_fallback_skips_a_pipeline_without_seqused(capability, monkeypatch):
    capability(9, 0)
    _, padded = _seqused_problems()
    device = torch.device("cuda")
    forward_only = _replace(monkeypatch, HOPPER, plan_backward=None,
                            capabilities=HOPPER.capabilities - {"backward"})
    assert dispatch.select_backward_pipeline(device, forward_only, padded) is AMPERE
    _replace(monkeypatch, AMPERE, capabilities=AMPERE.capabilities - {"seqused"})
    assert dispatch.select_backward_pipeline(device, forward_only).name == "ampere"
    with pytest.raises(NotImplementedError, match="seqused_q/seqused_k: not supported by the "
                                                  "ampere pipeline yet"):
        dispatch.select_backward_pipeline(device, forward_only, padded)


def test_seqused_changes_the_compile_keys():

    varlen, padded = _seqused_problems()
    assert ("seqused_q", True) in variant_of(varlen).flags()
    assert ("seqused_k", False) in variant_of(varlen).flags()
    assert ("seqused_k", True) in variant_of(padded).flags()
    plain = validate_attention_inputs(*(torch.randn(1, 10, 2, 64, dtype=torch.bfloat16),) * 3,
                                      require_cuda=False)
    keys = {launch_bwd.backward_compile_key("ampere.bwd", "sm_80", "bf16", p, (64, 128, 8))
            for p in (plain, padded)}
    assert len(keys) == 2


def test_seqused_rows_of_the_outputs_are_defined_before_launch():
    """Rows past seqused_q are never written by a kernel: O = 0 and LSE = -inf from the start."""

    varlen, _ = _seqused_problems()
    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, lse = launch_fwd.ForwardLaunch("x", object, q, q, q, varlen, cu, cu, cu[1:], None,
                                    (64, 64), "", "sm_90a")._alloc()
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    seqused = torch.tensor([3], dtype=torch.int32)
    padded = validate_attention_inputs(q[None], q[None], q[None], require_cuda=False,
                                       seqused_q=seqused)
    out, lse = launch_fwd.ForwardLaunch("x", object, q[None], q[None], q[None], padded, None, None,
                                    seqused, None, (64, 64), "", "sm_90a")._alloc()
    assert lse.shape == (1, 2, 10) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_launch_refuses_seqused_tensors_the_problem_was_not_validated_with():

    _, padded = _seqused_problems()
    q = torch.randn(1, 10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="problem was validated"):
        launch_fwd.ForwardLaunch("x", object, q, q, q, padded, None, None, None, None, (64, 64), "",
                             "sm_90a")


def test_call_key_holds_everything_validation_reads():
    q = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
    base = plans._call_key((q, q, q), ("padded", None, True))
    assert base == plans._call_key((q.clone(), q, q), ("padded", None, True))
    variants = [
        ((q.transpose(1, 2), q, q), ("padded", None, True)),  # strides
        ((q.half(), q, q), ("padded", None, True)),  # dtype
        ((q[:, :15], q, q), ("padded", None, True)),  # shape
        ((torch.randn(q.numel() + 4, dtype=q.dtype)[4:].view(q.shape), q, q),
         ("padded", None, True)),  # address 8 bytes past a 16-byte boundary
        ((q.clone().requires_grad_(), q, q), ("padded", None, True)),
        ((q, q, q), ("padded", None, 1)),  # 1 == True, but validation tells them apart
        ((q, q, q), ("padded", 0.125, True)),
    ]
    keys = [plans._call_key(t, o) for t, o in variants]
    assert None not in keys and base not in keys and len(set(keys)) == len(keys)
    with torch.no_grad():
        assert plans._call_key((q, q, q), ("padded", None, True)) != base
    # No key (validated on every call): tensor subclasses, unhashable or unusual options.
    assert plans._call_key((torch.nn.Parameter(q), q, q), ()) is None
    assert plans._call_key((q, q, q), ("padded", [None, 0])) is None
    assert plans._call_key((q, q, q), ("padded", torch.tensor(0.1))) is None


def test_a_repeated_call_is_validated_once(capability, monkeypatch):
    """The plan cache of the CUDA operator skips validation and dispatch for a call it has
    seen, and only then (`plans.forward` called directly: CPU tensors stand in for CUDA
    ones)."""
    import contextlib

    capability(9, 0)
    validated, launched = [], []

    def validate(*args, **kw):
        validated.append(kw["causal"])
        return validate_attention_inputs(*args, **{**kw, "require_cuda": False})

    def plan_forward(q, k, v, problem, *lengths):
        def launch(q, k, v, *lengths, rng_seed=None):
            launched.append((problem.causal, "hopper"))
            return q, torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return launch

    monkeypatch.setattr(call_pass, "validate_attention_inputs", validate)
    _replace(monkeypatch, HOPPER, plan_forward=plan_forward)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(plans, "on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(plans, "_PLANS", plans._BoundedCache(2))
    q = torch.randn(1, 33, 2, 64, dtype=torch.bfloat16)

    def call(causal=False, softcap=0.0, v=q):
        plans.forward(q, q, v, None, None, None, None, None, None, None, causal, None, None,
                      softcap, None, False, None, False, 0)

    for causal in (False, False, True, False, True):
        call(causal)
    assert validated == [False, True]
    assert launched == [(c, "hopper") for c in (False, False, True, False, True)]
    # Bad input is still refused after a good call of the same shape.
    with pytest.raises(ValueError, match="last"):
        call(v=q.transpose(-1, -2).contiguous().transpose(-1, -2))
    # The cache forgets its oldest entry beyond its size.
    call(softcap=5.0)
    call(causal=False)
    assert validated == [False, True, False, False, False]


@pytest.fixture(autouse=True)
def _fresh_plan_caches():
    """Plans are keyed by tensors and arguments, not by the faked capability: each test
    starts from empty caches."""
    plans.clear_plans()
    yield
    plans.clear_plans()


def test_plan_cache_forgets_the_least_recently_used_and_is_thread_safe():
    import threading

    cache = plans._BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # refreshed: "b" is now the oldest
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.get(None) is None and (cache.put(None, 4), len(cache))[1] == 2

    small, errors = plans._BoundedCache(8), []

    def hammer(seed):
        try:
            for i in range(3000):
                small.put((seed, i % 50), i)
                small.get((seed, (i * 7) % 50))
        except Exception as e:  # noqa: BLE001 - any exception is the failure
            errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(small) <= 8


def test_call_key_of_a_tensor_without_storage_is_none():
    q = torch.randn(2, 16, 4, 64)
    assert plans._call_key((q.to_sparse(), q, q), ()) is None


def test_second_order_gradients_are_refused():
    """Second-order gradients through attention are not implemented: gradients taken with
    create_graph=True raise when differentiated again, not silently give zero (on the CPU
    operators, which share the autograd of the CUDA ones)."""
    q = torch.randn(1, 33, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn(1, 33, 2, 64, dtype=torch.bfloat16), torch.randn(1, 33, 2, 64,
                                                                          dtype=torch.bfloat16)
    out, _ = flash_cute.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert torch.isfinite(dq).all() and dq.abs().max() > 0
    # A gradient penalty: the backward through dq reaches the refusal.
    with pytest.raises(RuntimeError, match="not differentiable"):
        (out.float().sum() + dq.float().pow(2).sum()).backward()
    # Without create_graph the gradients are plain tensors.
    out, _ = flash_cute.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    assert dq.grad_fn is None and not dq.requires_grad


def test_lazily_negated_views_are_refused():
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="resolve_neg"):
        validate_attention_inputs(torch._neg_view(q), q, q, require_cuda=False)
    validate_attention_inputs(torch._neg_view(q).resolve_neg(), q, q, require_cuda=False)


_FA4_COMBINE = [("out_partial", None), ("lse_partial", None), ("out", None), ("out_dtype", None),
                ("cu_seqlens", None), ("seqused", None), ("virtual_batch_idx", None),
                ("return_lse", True)]


def test_flash_attn_combine_has_fa4s_signature():
    import inspect

    params = inspect.signature(flash_cute.flash_attn_combine).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in params] == _FA4_COMBINE


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attn_combine_recovers_attention_from_key_splits(varlen):
    """Attention over three disjoint key ranges (one of them masked out for the first rows,
    LSE = -inf there), merged, equals attention over all keys (float64 reference)."""
    from flash_cute.reference.attention import attention_ref

    torch.manual_seed(0)
    q = torch.randn(2, 37, 3, 16, dtype=torch.float64)
    k, v = torch.randn(2, 50, 3, 16, dtype=torch.float64), torch.randn(2, 50, 3, 16, dtype=torch.float64)
    full, full_lse = attention_ref(q, k, v, mode="float64")
    outs, lses = [], []
    for a, b in ((0, 20), (20, 45), (45, 50)):
        o, lse = attention_ref(q, k[:, a:b], v[:, a:b], mode="float64")
        outs.append(o)
        lses.append(lse.transpose(1, 2))  # [b, h, s] -> FA4's [b, s, h]
    out_partial, lse_partial = torch.stack(outs), torch.stack(lses)
    lse_partial[2, :, :5] = -float("inf")  # the third split sees no key for 5 rows...
    out_partial[2, :, :5] = float("nan")  # ... whatever its partial output holds
    full5, full5_lse = attention_ref(q[:, :5], k[:, :45], v[:, :45], mode="float64")
    want, want_lse = full.clone(), full_lse.transpose(1, 2).clone()
    want[:, :5], want_lse[:, :5] = full5, full5_lse.transpose(1, 2)
    if varlen:
        out_partial, lse_partial = out_partial.flatten(1, 2), lse_partial.flatten(1, 2)
        want, want_lse = want.flatten(0, 1), want_lse.flatten(0, 1)
    out, lse = flash_cute.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float64 and torch.allclose(out, want) and torch.allclose(lse, want_lse)
    into = torch.empty_like(want, dtype=torch.float32)
    got, none = flash_cute.flash_attn_combine(out_partial, lse_partial, out=into, return_lse=False)
    assert got is into and none is None and torch.allclose(into.double(), want, atol=1e-6)
    with pytest.raises(ValueError, match="lse_partial"):
        flash_cute.flash_attn_combine(out_partial, lse_partial[..., :1])
