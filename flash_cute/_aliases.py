"""Compatibility aliases: the module paths from before the layered tree (`flash_cute.plans`,
`flash_cute.mod_graph`, `flash_cute.arch.hopper.api`, ...) keep working for one release.

Importing an old path warns once (FutureWarning). A module that moved whole comes back as the
module of its new path, the same object; a module that was split into several (a tuple below)
comes back as a small module of its own that looks each name up in its new homes, in order.
No module is ever executed a second time (running the operators' module twice would define the
torch library twice), and a submodule of an old package path (`flash_cute.bench.cli`) is the
new package's. Renamed functions are not forwarded. `docs/architecture.md` has the table.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

OLD_PATHS = {
    "flash_cute.pipeline": "flash_cute.contract.descriptor",
    "flash_cute.variant": "flash_cute.contract.variant",
    "flash_cute.kernel_args": ("flash_cute.contract.kernel_args", "flash_cute.tools.fake_args"),
    "flash_cute.block_range": "flash_cute.contract.block_range",
    "flash_cute.tile_scheduler": ("flash_cute.contract.tile_order", "flash_cute.blocks.work_loop"),
    "flash_cute.constants": "flash_cute.contract.constants",
    "flash_cute.row_split": "flash_cute.contract.row_split",
    "flash_cute.score": "flash_cute.blocks.score",
    "flash_cute.softmax": "flash_cute.blocks.softmax",
    "flash_cute.mask": "flash_cute.blocks.mask",
    "flash_cute.seqlen": "flash_cute.blocks.seqlen",
    "flash_cute.dropout": "flash_cute.blocks.dropout",
    "flash_cute.exp2_emu": ("flash_cute.blocks.exp2_emu", "flash_cute.tools.block_kernels"),
    "flash_cute.lse_merge": (
        "flash_cute.blocks.lse_merge",
        "flash_cute.runtime.lse_merge",
        "flash_cute.kernels.lse_merge",
    ),
    "flash_cute.bwd_blocks": "flash_cute.blocks.bwd",
    "flash_cute.graph_mods": ("flash_cute.blocks.graph_mods", "flash_cute.tools.block_kernels"),
    "flash_cute.fa4_mods": (
        "flash_cute.blocks.fa4_mods",
        "flash_cute.variants.fa4_spec",
        "flash_cute.contract.mods",
    ),
    "flash_cute.fa4_mod_examples": "flash_cute.blocks.fa4_mod_examples",
    "flash_cute.layouts": "flash_cute.blocks.layouts",
    "flash_cute.dsl_state": "flash_cute.blocks.dsl_state",
    "flash_cute.work_loop": "flash_cute.blocks.work_loop",
    "flash_cute.kv_append": "flash_cute.blocks.kv_append",
    "flash_cute.row_io": "flash_cute.blocks.row_io",
    "flash_cute.bwd_prep_kernels": "flash_cute.kernels.bwd_prep",
    "flash_cute.mod_graph": "flash_cute.variants.mod_graph",
    "flash_cute.mod_examples": ("flash_cute.variants.examples", "flash_cute.tools.kernel_config"),
    "flash_cute.block_mask": "flash_cute.variants.block_mask",
    "flash_cute.models": "flash_cute.reference.block_models",
    "flash_cute.rng": "flash_cute.reference.rng",
    "flash_cute.validation": (
        "flash_cute.runtime.problem",
        "flash_cute.runtime.checks",
        "flash_cute.runtime.contents",
    ),
    "flash_cute.plans": ("flash_cute.runtime.plans", "flash_cute.runtime.call"),
    "flash_cute.dispatch": "flash_cute.runtime.dispatch",
    "flash_cute.launch": (
        "flash_cute.runtime.launch",
        "flash_cute.runtime.launch_fwd",
        "flash_cute.runtime.launch_bwd",
        "flash_cute.runtime.kernel_ref",
    ),
    "flash_cute.jit": "flash_cute.runtime.jit",
    "flash_cute.disk_cache": "flash_cute.runtime.disk_cache",
    "flash_cute.splits": "flash_cute.runtime.splits",
    "flash_cute.paging": "flash_cute.runtime.paging",
    "flash_cute.device": "flash_cute.runtime.device",
    "flash_cute.bwd_prep": "flash_cute.runtime.bwd_prep",
    "flash_cute.interface": "flash_cute.api.interface",
    "flash_cute.ops": "flash_cute.api.ops",
    "flash_cute.kvcache": "flash_cute.api.kvcache",
    "flash_cute.combine": "flash_cute.api.combine",
    "flash_cute.bench": "flash_cute.tools.bench",
    "flash_cute.bench_decode": "flash_cute.tools.bench_decode",
    "flash_cute.bench_latency": "flash_cute.tools.bench_latency",
    "flash_cute.inspection": "flash_cute.tools.inspection",
    "flash_cute.registry": "flash_cute.tools.registry",
    "flash_cute.kernel_config": "flash_cute.tools.kernel_config",
    "flash_cute.xcompile": "flash_cute.tools.xcompile",
    "flash_cute.sass": "flash_cute.tools.sass",
    "flash_cute.selfcheck": "flash_cute.tools.selfcheck",
    "flash_cute.cache_cli": "flash_cute.tools.cache_cli",
    "flash_cute.score_attention": "flash_cute.tools.block_kernels",
    "flash_cute.arch.ampere.pipeline": "flash_cute.arch.ampere.descriptor",
    "flash_cute.arch.ampere.api": "flash_cute.arch.ampere.planner",
    "flash_cute.arch.ampere.registry": "flash_cute.arch.ampere.inspect_configs",
    "flash_cute.arch.hopper.pipeline": "flash_cute.arch.hopper.descriptor",
    "flash_cute.arch.hopper.api": "flash_cute.arch.hopper.planner",
    "flash_cute.arch.hopper.registry": "flash_cute.arch.hopper.inspect_configs",
    "flash_cute.arch.blackwell.pipeline": "flash_cute.arch.blackwell.descriptor",
    "flash_cute.arch.blackwell.api": "flash_cute.arch.blackwell.planner",
    "flash_cute.arch.blackwell.registry": "flash_cute.arch.blackwell.inspect_configs",
    "flash_cute.arch.hopper.dq_layout": "flash_cute.arch.hopper.host_dq_layout",
}


def _new_path(name: str):
    """The new path(s) of an old module path, or of a submodule of an old package path."""
    if name in OLD_PATHS:
        return OLD_PATHS[name]
    for old, new in OLD_PATHS.items():
        if isinstance(new, str) and name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def _forwarding(name: str, homes: tuple) -> types.ModuleType:
    """A module of the old path `name` whose attributes are looked up in `homes`, in order."""
    module = types.ModuleType(name, f"The old path of {', '.join(homes)} (split).")

    def __getattr__(attr):
        for home in homes:
            value = getattr(importlib.import_module(home), attr, module)
            if value is not module:
                return value
        raise AttributeError(f"module {name!r} (now {', '.join(homes)}) has no attribute {attr!r}")

    module.__getattr__ = __getattr__
    return module


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths only; loads each as the module(s) of its new path(s)."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, name, path=None, target=None):
        if _new_path(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = _new_path(spec.name)
        shown = new if isinstance(new, str) else ", ".join(new)
        warnings.warn(
            f"{spec.name} has moved to {shown}; the old path goes in the next release",
            FutureWarning,
            stacklevel=3,
        )
        if not isinstance(new, str):
            return _forwarding(spec.name, new)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias's spec on a moved module: give it its own back.
        # Nothing runs: the module was executed once, under its new name.
        original = self._specs.pop(module.__spec__.name, None) if module.__spec__ else None
        if original is not None:
            module.__spec__ = original


def install() -> None:
    if not any(isinstance(f, _Aliases) for f in sys.meta_path):
        sys.meta_path.append(_Aliases())
