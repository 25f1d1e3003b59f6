"""The package's import graph, read from the source by `import_rules`: the layer table (each
layer imports only the layers below it; the runtime reaches kernels only by name), the DSL
and torch rules, no cycle, the installed packages equal to the package folders, and a light
`import flash_cute`. The checker is tested on planted modules too."""

import subprocess
import sys

import import_rules as rules
import pytest


def test_every_module_has_a_layer():
    missing = []
    for name, text in rules.package_modules().items():
        if text is None:
            continue
        try:
            rules.layer_of(name)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, missing


def test_the_tree_follows_the_layer_rules():
    found = rules.violations(rules.package_modules())
    assert not found, "\n".join(found)


def test_the_installed_packages_are_the_package_folders():
    installed, folders = rules.installed_packages(), rules.package_folders()
    assert installed == folders, (f"in pyproject.toml only: {sorted(installed - folders)}; "
                                  f"folders pyproject.toml misses: {sorted(folders - installed)}")


def test_layers_read_from_paths():
    assert rules.layer_of("flash_cute.contract.variant") == "contract"
    assert rules.layer_of("flash_cute.runtime.plans") == "runtime"
    assert rules.layer_of("flash_cute.arch.hopper.fwd") == "kernels"
    assert rules.layer_of("flash_cute.arch.hopper.descriptor") == "contract"
    assert rules.layer_of("flash_cute.arch.hopper.planner") == "runtime"
    assert rules.layer_of("flash_cute.arch.hopper.host_dq_layout") == "runtime"
    assert rules.layer_of("flash_cute.arch.hopper.inspect_configs") == "tools"
    assert rules.layer_of("flash_cute.integrations.sdpa") == "api"
    assert rules.layer_of("flash_cute.__main__") == "tools"


def _planted(**modules) -> dict:
    """A small package: the real tree's module names, with planted sources."""
    base = {"flash_cute": "", "flash_cute.__init__": None}
    base.update({k.replace("__", "."): v for k, v in modules.items()})
    return base


def test_the_checker_finds_a_planted_cycle():
    tree = _planted(flash_cute__runtime__a="from flash_cute.runtime import b\n",
                    flash_cute__runtime__b="def f():\n    from flash_cute.runtime import a\n")
    tree.update({"flash_cute.runtime": "", "flash_cute.runtime.__init__": None})
    assert any(v.startswith("import cycle") for v in rules.violations(tree))


def test_the_checker_finds_a_string_import_of_tooling_from_the_runtime():
    tree = _planted(flash_cute__tools__registry="",
                    flash_cute__runtime__plans=(
                        "import importlib\n"
                        "def configs():\n"
                        "    return importlib.import_module('flash_cute.tools.registry')\n"))
    bad = rules.violations(tree)
    assert any("flash_cute.runtime.plans [runtime] imports flash_cute.tools.registry (by name"
               in v for v in bad), bad


@pytest.mark.parametrize("call", [
    "importlib.import_module(f'flash_cute.tools.{n}')",
    "__import__('flash_cute.tools.registry')",
    "KernelRef(module='flash_cute.tools.registry', name='X')",
])
def test_the_checker_reads_every_form_of_a_module_named_by_a_string(call):
    """f-strings by their literal start, `__import__`, and the `module=` keyword are edges."""
    tree = _planted(flash_cute__tools__registry="",
                    flash_cute__runtime__plans=f"import importlib\ndef f(n):\n    {call}\n")
    tree.update({"flash_cute.tools": "", "flash_cute.tools.__init__": None})
    assert any("flash_cute.runtime.plans [runtime] imports flash_cute.tools" in v
               for v in rules.violations(tree)), call


def test_the_checker_refuses_a_computed_module_name_outside_the_allowed_places():
    source = "import importlib\nM = 'flash_cute.tools.registry'\ndef f():\n" \
             "    importlib.import_module(M)\n"
    assert rules.violations(_planted(flash_cute__runtime__plans=source))
    assert rules.violations(_planted(flash_cute__runtime__kernel_ref=source)) == []


def test_the_checker_allows_kernels_by_name_only():
    by_name = _planted(flash_cute__kernels__k="",
                       flash_cute__runtime__launch="REF = KernelRef('flash_cute.kernels.k', 'K')\n")
    assert rules.violations(by_name) == []
    imported = _planted(flash_cute__kernels__k="",
                        flash_cute__runtime__launch="def f():\n    import flash_cute.kernels.k\n")
    assert rules.violations(imported)


def test_the_checker_allows_the_dsl_at_module_level_only_where_the_rules_say():
    """Blocks import the DSL at module level; the runtime only through the JIT, and the disk
    cache only inside a function."""
    assert rules.violations(_planted(flash_cute__blocks__b="import cutlass\n")) == []
    assert rules.violations(_planted(flash_cute__runtime__jit="import cutlass\n")) == []
    lazy = "def load():\n    import cutlass\n"
    assert rules.violations(_planted(flash_cute__runtime__disk_cache=lazy)) == []
    assert rules.violations(_planted(flash_cute__runtime__disk_cache="import cutlass\n"))
    assert rules.violations(_planted(flash_cute__runtime__plans=lazy))


@pytest.mark.parametrize("source", ["import cutlass\n",
                                    "def f():\n    from cutlass import Int32\n",
                                    "import torch\n"])
def test_the_checker_finds_a_planted_dsl_or_torch_import_in_contract(source):
    tree = _planted(flash_cute__contract__records=source)
    assert rules.violations(tree), source


def test_import_flash_cute_is_light():
    """`import flash_cute` (the API and every pipeline) imports no CuTe DSL and none of the
    tooling: it must stay cheap for a training script that only calls the API. It does import
    tvm_ffi, which every launch needs (D-IMPORT)."""
    code = ("import sys, flash_cute, flash_cute.runtime.dispatch as d; "
            "assert d.PIPELINES; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass' "
            "or m.startswith('flash_cute.tools') or m.endswith('.inspect_configs')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


def test_named_barrier_ids_computed_at_run_time_are_the_declared_ones():
    """Ids the kernels compute from a warpgroup index (1 + w, 2 + w, the dQ pair + w·stride)
    land on the enum's own members, so the enum's uniqueness check covers them."""
    from flash_cute.arch.hopper.bwd import _DQ_WG_BARRIER_STRIDE, BwdBarrier
    from flash_cute.arch.hopper.fwd import FwdBarrier

    assert [FwdBarrier.PINGPONG + w for w in range(3)] == [
        FwdBarrier.PINGPONG, FwdBarrier.PINGPONG_WG1, FwdBarrier.PINGPONG_WG2]
    assert BwdBarrier.WG0_P + 1 == BwdBarrier.WG1_P
    assert (BwdBarrier.DQ_FULL + _DQ_WG_BARRIER_STRIDE,
            BwdBarrier.DQ_EMPTY + _DQ_WG_BARRIER_STRIDE) == (BwdBarrier.DQ_FULL_WG1,
                                                             BwdBarrier.DQ_EMPTY_WG1)
