"""How the runtime names a kernel without importing it."""

import importlib
from typing import NamedTuple


class KernelRef(NamedTuple):
    """A kernel class named by its module, imported when a kernel is first built: a call whose
    kernels come from the disk cache never imports the CuTe DSL modules (tens of ms)."""
    module: str
    name: str

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)
