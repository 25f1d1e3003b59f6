"""The package's import graph, read from the source: no cycles, and the runtime (what a call
of the public API can reach) imports none of the tooling (inspect, bench, the registry, the
cross-compiler, the SASS reader)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folders and the package names they are installed as.
SOURCES = {"flash_cute": ROOT / "flash_cute", "flash_cute.arch": ROOT / "arch"}
TOOLING = {"flash_cute.tools.registry", "flash_cute.tools.kernel_config", "flash_cute.tools.xcompile",
           "flash_cute.tools.sass", "flash_cute.tools.inspection", "flash_cute.tools.bench", "flash_cute.tools.bench_latency",
           "flash_cute.tools.bench_decode",
           "flash_cute.tools.selfcheck", "flash_cute.tools.cache_cli", "flash_cute.__main__"}
# A pipeline descriptor's lazy reference to its inspect configs (`Pipeline.inspect_configs`):
# the one place the runtime names tooling, in a function only `inspect` calls.
LAZY_REGISTRY_HOOK = "_inspect_configs"


def _modules() -> dict:
    """Module name -> source file, for every module of the package."""
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package] + parts)] = path
    return out


def _is_package(name: str, modules: dict) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules: dict) -> list:
    """(imported module, enclosing function or None) for every import statement of `name`
    that names a module of the package."""
    tree = ast.parse(modules[name].read_text())
    base = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = []

    def resolve(module, level):
        if level:
            parent = base
            for _ in range(level - 1):
                parent = parent.rpartition(".")[0]
            return f"{parent}.{module}" if module else parent
        return module

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            if isinstance(child, ast.Import):
                found.extend((a.name, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(child.module, child.level)
                for a in child.names:
                    # `from flash_cute import launch` imports the submodule; `from
                    # flash_cute.runtime.jit import launch_kernel` the module it names.
                    sub = f"{target}.{a.name}"
                    found.append((sub if sub in modules else target, func))
            visit(child, inner)

    visit(tree, None)
    return [(m, f) for m, f in found if m in modules and m != name]


def _graph():
    modules = _modules()
    return modules, {name: _imports(name, modules) for name in modules}


def _tooling(name: str) -> bool:
    return name in TOOLING or (name.startswith("flash_cute.arch.") and name.endswith(".inspect_configs"))


def test_the_import_graph_has_no_cycle():
    modules, graph = _graph()
    state, path = {}, []

    def walk(node):
        state[node] = "open"
        path.append(node)
        for target, _ in graph[node]:
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                walk(target)
        path.pop()
        state[node] = "done"

    for name in sorted(modules):
        if name not in state:
            walk(name)


def test_the_runtime_imports_no_tooling():
    modules, graph = _graph()
    bad = []
    for name in modules:
        if _tooling(name):
            continue
        for target, func in graph[name]:
            hook = (func == LAZY_REGISTRY_HOOK and name.endswith(".descriptor")
                    and target == name.rpartition(".")[0] + ".inspect_configs")
            if _tooling(target) and not hook:
                bad.append(f"{name} ({func or 'module level'}) imports {target}")
    assert not bad, "\n".join(bad)


def test_the_graph_reader_sees_the_imports_it_should():
    """A check of the checker: known edges of the tree, at module level and inside functions."""
    _, graph = _graph()
    assert ("flash_cute.runtime.dispatch", None) in graph["flash_cute.runtime.plans"]
    assert ("flash_cute.arch.hopper.inspect_configs", LAZY_REGISTRY_HOOK) in \
        graph["flash_cute.arch.hopper.descriptor"]
    assert ("flash_cute.arch.hopper.host_dq_layout", "_bwd_plan") in graph["flash_cute.arch.hopper.planner"]


def test_import_flash_cute_is_light():
    """`import flash_cute` (the API and every pipeline descriptor) imports no CuTe DSL and none
    of the tooling: it must stay cheap for a training script that only calls the API. It does
    import tvm_ffi, which every launch needs (D-IMPORT)."""
    import subprocess
    import sys

    code = ("import sys, flash_cute, flash_cute.runtime.dispatch as d; "
            "assert d.PIPELINES; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass' "
            "or m in %r))" % sorted(TOOLING))
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
