"""Compatibility aliases: the module paths from before the layered tree (`flash_cute.plans`,
`flash_cute.mod_graph`, `flash_cute.arch.hopper.api`, ...) keep working for one release.

Importing an old path warns once (FutureWarning) and hands back the module under its new
name, the same object: the module is never executed a second time (running the operators'
module twice would define the torch library twice). `docs/architecture.md` has the table.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

OLD_PATHS = {
    "flash_cute.pipeline": "flash_cute.contract.descriptor",
    "flash_cute.variant": "flash_cute.contract.variant",
    "flash_cute.kernel_args": "flash_cute.contract.kernel_args",
    "flash_cute.block_range": "flash_cute.contract.block_range",
    "flash_cute.tile_scheduler": "flash_cute.contract.tile_order",
    "flash_cute.constants": "flash_cute.contract.constants",
    "flash_cute.row_split": "flash_cute.contract.row_split",
    "flash_cute.score": "flash_cute.blocks.score",
    "flash_cute.softmax": "flash_cute.blocks.softmax",
    "flash_cute.mask": "flash_cute.blocks.mask",
    "flash_cute.seqlen": "flash_cute.blocks.seqlen",
    "flash_cute.dropout": "flash_cute.blocks.dropout",
    "flash_cute.exp2_emu": "flash_cute.blocks.exp2_emu",
    "flash_cute.lse_merge": "flash_cute.blocks.lse_merge",
    "flash_cute.bwd_blocks": "flash_cute.blocks.bwd",
    "flash_cute.graph_mods": "flash_cute.blocks.graph_mods",
    "flash_cute.fa4_mods": "flash_cute.blocks.fa4_mods",
    "flash_cute.fa4_mod_examples": "flash_cute.blocks.fa4_mod_examples",
    "flash_cute.layouts": "flash_cute.blocks.layouts",
    "flash_cute.dsl_state": "flash_cute.blocks.dsl_state",
    "flash_cute.work_loop": "flash_cute.blocks.work_loop",
    "flash_cute.kv_append": "flash_cute.blocks.kv_append",
    "flash_cute.row_io": "flash_cute.blocks.row_io",
    "flash_cute.bwd_prep_kernels": "flash_cute.kernels.bwd_prep",
    "flash_cute.mod_graph": "flash_cute.variants.mod_graph",
    "flash_cute.mod_examples": "flash_cute.variants.examples",
    "flash_cute.block_mask": "flash_cute.variants.block_mask",
    "flash_cute.models": "flash_cute.reference.block_models",
    "flash_cute.rng": "flash_cute.reference.rng",
    "flash_cute.validation": "flash_cute.runtime.problem",
    "flash_cute.plans": "flash_cute.runtime.plans",
    "flash_cute.dispatch": "flash_cute.runtime.dispatch",
    "flash_cute.launch": "flash_cute.runtime.launch",
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


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths only; loads each as the module of its new path."""

    def find_spec(self, name, path=None, target=None):
        if name not in OLD_PATHS:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = OLD_PATHS[spec.name]
        warnings.warn(f"{spec.name} has moved to {new}; the old path goes in the next release",
                      FutureWarning, stacklevel=3)
        module = importlib.import_module(new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias's spec on the module: give it its own back.
        # Nothing runs: the module was executed once, under its new name.
        module.__spec__ = self._spec


def install() -> None:
    if not any(isinstance(f, _Aliases) for f in sys.meta_path):
        sys.meta_path.append(_Aliases())
