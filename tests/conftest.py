"""GPU tests are marked `gpu` and skip without CUDA; everything else runs on the CPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def capability(monkeypatch):
    """Dispatch as on a device of compute capability (major, minor), with no GPU."""
    from flash_cute.runtime import dispatch

    def set_cap(major, minor=0):
        monkeypatch.setattr(dispatch, "capability_of", lambda device: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name",
                            lambda device=None: f"fake sm_{major}{minor}")
    return set_cap
