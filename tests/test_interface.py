"""Dispatch and API contracts that need no GPU."""

import pytest
import torch

import flash_cute
from flash_cute import interface
from flash_cute.arch.ampere import api as ampere_api
from flash_cute.arch.hopper import api as hopper_api
from flash_cute.validation import validate_attention_inputs


@pytest.fixture
def capability(monkeypatch):
    def set_cap(major, minor=0):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"fake sm_{major}{minor}")
    return set_cap


def test_dispatch_picks_the_newest_pipeline_that_runs_there(capability):
    capability(8, 0)
    assert interface.select_pipeline(torch.device("cuda")) == "ampere"
    capability(9, 0)
    assert interface.select_pipeline(torch.device("cuda")) == "hopper"
    capability(10, 0)  # WGMMA does not exist on sm100: the sm80 code runs there
    assert interface.select_pipeline(torch.device("cuda")) == "ampere"


def test_arch_override(capability):
    capability(9, 0)
    assert interface.select_pipeline(torch.device("cuda"), "ampere") == "ampere"
    with pytest.raises(NotImplementedError, match="no such pipeline"):
        interface.select_pipeline(torch.device("cuda"), "volta")


def test_old_gpus_are_refused(capability):
    capability(7, 5)
    with pytest.raises(NotImplementedError, match="7.x"):
        interface.select_pipeline(torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on compute capability 8.x"):
        interface.select_pipeline(torch.device("cuda"), "ampere")


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
    assert interface.select_pipeline(torch.device("cuda"), "hopper") == "hopper"
    for major in (8, 10):
        capability(major, 0)
        with pytest.raises(ValueError, match="runs on compute capability 9.x"):
            interface.select_pipeline(torch.device("cuda"), "hopper")


def test_backward_falls_back_to_a_pipeline_that_has_one(capability):
    capability(9, 0)
    assert interface.select_backward_pipeline(torch.device("cuda"), "hopper") == "ampere"
    assert interface.select_backward_pipeline(torch.device("cuda"), "ampere") == "ampere"


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
    assert not hasattr(hopper_api, "backward")


def test_hopper_tma_strides_of_size_one_dims_are_made_compact():
    x = torch.randn(7, 3, 64).unsqueeze(0).as_strided((1, 7, 3, 64), (5, 192, 64, 1))
    y = hopper_api._tma_ready(x)
    assert y.stride() == (1344, 192, 64, 1) and torch.equal(x, y)
    z = torch.randn(2, 7, 3, 64)
    assert hopper_api._tma_ready(z) is z


def test_cpu_tensors_are_refused_before_any_launch():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        flash_cute.flash_attn_func(q, q, q)


def test_api_signature_matches_flash_attn_cute():
    import inspect

    params = list(inspect.signature(flash_cute.flash_attn_func).parameters)
    assert params[:3] == ["q", "k", "v"]
    assert {"softmax_scale", "causal", "window_size", "softcap", "deterministic", "return_lse"} <= set(params)
    varlen = list(inspect.signature(flash_cute.flash_attn_varlen_func).parameters)
    assert varlen[:7] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
