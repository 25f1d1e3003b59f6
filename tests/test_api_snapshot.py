"""The frozen public surface: the top-level names and their signatures, flash_attn 2's module,
the integrations, the operators' schemas, the CLI's commands and the registry's kernel names.
A change to any of them is a change to `tests/api_snapshot.json`, made on purpose in the same
commit (`FLASH_CUTE_WRITE_SNAPSHOT=1 pytest tests/test_api_snapshot.py` rewrites it; trailing
arguments with defaults may be added, nothing else)."""

import importlib
import inspect
import json
import os
import warnings
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("api_snapshot.json")
MODULES = ("flash_cute", "flash_cute.flash_attn_interface", "flash_cute.integrations.sdpa",
           "flash_cute.integrations.transformers", "flash_cute.parallel",
           "flash_cute.parallel.ring_flash_attn")


def _signatures(module) -> dict:
    names = getattr(module, "__all__", None) or [
        n for n, v in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == module.__name__]
    out = {}
    for name in sorted(names):
        value = getattr(module, name)
        try:
            out[name] = str(inspect.signature(value))
        except (TypeError, ValueError):
            out[name] = type(value).__name__
    return out


def _surface() -> dict:
    import torch

    import flash_cute  # noqa: F401  (registers the operators)
    from flash_cute import __main__ as cli
    from flash_cute.tools.registry import CONFIGS

    parser = cli._parser()
    commands = sorted(next(a for a in parser._actions if a.dest == "command").choices)
    return {
        "modules": {m: _signatures(importlib.import_module(m)) for m in MODULES},
        "operators": {op: str(getattr(torch.ops.flash_cute, op).default._schema)
                      for op in ("fwd", "bwd")},
        "commands": commands,
        "kernels": sorted({c.kernel for c in CONFIGS}),
    }


def test_the_public_surface_is_the_snapshot():
    surface = json.loads(json.dumps(_surface()))
    if os.environ.get("FLASH_CUTE_WRITE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    assert surface == json.loads(SNAPSHOT.read_text())


_CHECK_OLD = """
import importlib, json, sys, warnings
from flash_cute import _aliases
out = {}
for old, name in (a.split(":") for a in sys.argv[1:]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    new = _aliases.OLD_PATHS.get(old, old)
    homes = (new,) if isinstance(new, str) else new
    home = next(h for h in homes if hasattr(importlib.import_module(h), name))
    out[old] = [module is importlib.import_module(home) if isinstance(new, str) else None,
                getattr(module, name) is getattr(importlib.import_module(home), name),
                module.__spec__.name if isinstance(new, str) else home,
                [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]]
print(json.dumps(out))
"""

# Old paths the README showed, and others, each with a name users reached through it.
OLD_NAMES = ["flash_cute.mod_graph:register", "flash_cute.plans:clear_plans",
             "flash_cute.mod_examples:alibi", "flash_cute.fa4_mod_examples:EXAMPLES",
             "flash_cute.block_mask:kernel_tiles", "flash_cute.reference:attention_ref",
             "flash_cute.arch.hopper.api:plan_forward", "flash_cute.launch:ForwardLaunch",
             "flash_cute.validation:check_index_contents", "flash_cute.lse_merge:lse_merge",
             "flash_cute.bench.cli:main"]


def test_old_paths_users_were_shown_still_import():
    """The paths the README showed keep working for one release, with a FutureWarning naming
    the new path: a module that moved whole is the same object under its own spec (never a
    second execution); a split one forwards each name to the module that now holds it.
    `flash_cute.reference` did not move (it is the package now) and does not warn."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _CHECK_OLD, *OLD_NAMES], capture_output=True,
                          text=True, check=True)
    for old, (same, found, where, warned) in json.loads(proc.stdout).items():
        assert same in (True, None) and found, (old, where)
        if old == "flash_cute.reference":
            assert not warned
        else:
            assert len(warned) == 1 and where.rsplit(".", 1)[0] in warned[0], (old, warned)


def test_an_alias_never_runs_a_module_twice():
    """The operators' module imported by its old path is the module already loaded: running it
    again would define the torch library a second time and raise."""
    import sys

    from flash_cute.api import ops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = importlib.import_module("flash_cute.ops")
    assert old is ops and sys.modules["flash_cute.ops"] is ops


def test_user_facing_names_import_from_the_top():
    import flash_cute
    from flash_cute.blocks import fa4_mod_examples  # noqa: F401  (FA4-form templates)
    from flash_cute.variants import examples  # noqa: F401  (FlexAttention-form mods)

    for name in ("register_mods", "clear_plans", "create_block_mask", "check_inputs",
                 "UnsupportedMod", "flash_attn_func", "flash_attn_with_kvcache"):
        assert hasattr(flash_cute, name), name
    assert issubclass(flash_cute.UnsupportedMod, TypeError)
