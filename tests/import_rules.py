"""The layer rules of the package, and a checker that reads them from the source (no import).

A module's layer comes from its path (`layer_of`); each layer may import the layers of
`ALLOWED` and its own. An edge is an import statement (at module level or in a function),
an `importlib.import_module("...")` call or a `KernelRef("...", ...)` with a constant module
name: the last two are edges "by name", the only way the runtime may reach a kernel.
`docs/architecture.md` states the same table.
"""

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Source folders and the package names they are installed as.
SOURCES = {"flash_cute": ROOT / "flash_cute", "flash_cute.arch": ROOT / "arch"}

# Sub-package prefix -> layer. The longest prefix wins; `flash_cute` alone is the package's
# __init__ (the public names: API level).
PREFIXES = {
    "flash_cute.contract": "contract",
    "flash_cute.blocks": "blocks",
    "flash_cute.kernels": "kernels",
    "flash_cute.variants": "variants",
    "flash_cute.reference": "reference",
    "flash_cute.runtime": "runtime",
    "flash_cute.api": "api",
    "flash_cute.integrations": "api",
    "flash_cute.flash_attn_interface": "api",
    # Reserved for this wave: context parallelism and the FP8 helpers sit on the API.
    "flash_cute.parallel": "api",
    "flash_cute.fp8": "api",
    "flash_cute": "package",
    "flash_cute.tools": "tools",
    "flash_cute.__main__": "tools",
    "flash_cute._aliases": "compat",
    "flash_cute.arch": "contract",
}
# Files of `arch/<name>/` by stem: the rest are kernel files (kernels and their arch helpers).
ARCH_STEMS = {"descriptor": "contract", "config": "contract", "planner": "runtime",
              "host": "runtime", "inspect_configs": "tools"}
ARCH_STEM_PREFIXES = {"host_": "runtime"}

BELOW = {
    "contract": set(),
    "blocks": {"contract"},
    "kernels": {"contract", "blocks"},
    "variants": {"contract"},
    "reference": {"contract", "variants"},
    "runtime": {"contract", "variants", "reference"},
    "api": {"contract", "variants", "reference", "runtime"},
    "tools": {"contract", "blocks", "kernels", "variants", "reference", "runtime", "api",
              "package"},
    # The package's __init__: the public names, and the old paths' aliases installed.
    "package": {"contract", "variants", "reference", "runtime", "api", "compat"},
    "compat": {"contract", "blocks", "kernels", "variants", "reference", "runtime", "api",
               "tools"},
}
ALLOWED = {layer: below | {layer} for layer, below in BELOW.items()}
# Edges allowed by name only (`KernelRef`, `importlib.import_module`): the runtime names
# kernels, it never imports them.
BY_NAME = {"runtime": {"kernels"}, "api": {"kernels"}, "package": {"kernels"}}
# CuTe DSL (and the CUDA driver bindings it runs on): imported at module level only by the
# layers that are device code or tooling, and by the JIT, the runtime's one way to it; never,
# not even inside a function, by the torch-only layers and the rest of the runtime.
DSL_ROOTS = {"cutlass", "cuda", "nvidia_cutlass_dsl"}
DSL_AT_MODULE_LEVEL = {"blocks", "kernels", "tools"}
DSL_NEVER = {"contract", "variants", "reference", "runtime", "package", "compat"}
# The JIT, the runtime's one way to the DSL (at module level too), and its disk cache, which
# loads compiled modules through the DSL's runtime inside its functions.
JIT = "flash_cute.runtime.jit"
DSL_LAZY = {JIT, "flash_cute.runtime.disk_cache"}
# A module named by a computed string (not a literal, nor an f-string with a literal start):
# the checker cannot see its layer, so only these may (`KernelRef` itself, the aliases).
DYNAMIC_IMPORT = "<computed>"
DYNAMIC = {"flash_cute.runtime.kernel_ref", "flash_cute._aliases"}
# Layers that never import torch: records and device code.
NO_TORCH = {"contract", "blocks", "kernels"}


def layer_of(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["flash_cute", "arch"] and len(parts) == 4:
        stem = parts[3]
        for prefix, layer in ARCH_STEM_PREFIXES.items():
            if stem.startswith(prefix):
                return layer
        return ARCH_STEMS.get(stem, "kernels")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in PREFIXES:
            return PREFIXES[prefix]
    raise KeyError(f"{name}: no layer for this path")


def package_modules() -> dict:
    """Module name -> source text, for every module of the package."""
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                out[".".join([package] + parts) + ".__init__"] = None
            out[".".join([package] + parts)] = path.read_text()
    return out


class Edge:
    __slots__ = ("target", "func", "by_name")

    def __init__(self, target, func, by_name=False):
        self.target, self.func, self.by_name = target, func, by_name

    def __repr__(self):
        how = "by name" if self.by_name else "import"
        return f"{self.target} ({how}, {self.func or 'module level'})"


def _is_package(name: str, modules: dict) -> bool:
    return name + ".__init__" in modules


def edges(name: str, modules: dict) -> tuple:
    """(every edge of `name` to a module of the package, the `(root, func)` pairs of its
    imports from outside the package: the DSL and torch rules read them)."""
    tree = ast.parse(modules[name])
    base = name if _is_package(name, modules) else name.rpartition(".")[0]
    found, outside = [], []

    def resolve(module, level):
        if level:
            parent = base
            for _ in range(level - 1):
                parent = parent.rpartition(".")[0]
            return f"{parent}.{module}" if module else parent
        return module

    def add(target, func, by_name=False):
        if target.split(".")[0] != "flash_cute":
            outside.append((target.split(".")[0], func))
            return
        # `import a.b.c` names the deepest module that exists.
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        if target in modules and target != name:
            found.append(Edge(target, func, by_name))

    def named_module(call):
        """The module an `import_module` / `__import__` / `KernelRef` call names: a string
        literal whole, an f-string by its literal start (`f"flash_cute.arch.{n}.x"` names
        `flash_cute.arch`), or None when it is computed (then `DYNAMIC` says who may)."""
        node = call.args[0] if call.args else next(
            (k.value for k in call.keywords if k.arg in ("module", "name")), None)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr) and node.values and \
                isinstance(node.values[0], ast.Constant):
            return node.values[0].value.rpartition(".")[0] or None
        return None

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            if isinstance(child, ast.Import):
                for a in child.names:
                    add(a.name, func)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(child.module, child.level)
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    add(sub if sub in modules else target, func)
            elif isinstance(child, ast.Call):
                callee = child.func.attr if isinstance(child.func, ast.Attribute) else \
                    getattr(child.func, "id", None)
                if callee in ("import_module", "KernelRef", "__import__"):
                    text = named_module(child)
                    if text:
                        add(text, func, by_name=True)
                    else:
                        outside.append((DYNAMIC_IMPORT, func))
            visit(child, inner)

    visit(tree, None)
    return found, outside


def graph(modules: dict) -> tuple:
    """(edges per module, outside imports per module)."""
    out, outside = {}, {}
    for name, text in modules.items():
        if text is None:
            continue
        out[name], outside[name] = edges(name, modules)
    return out, outside


def cycles(g: dict) -> list:
    """One cycle per strongly connected part found by a depth-first walk."""
    state, path, found = {}, [], []

    def walk(node):
        state[node] = "open"
        path.append(node)
        for e in g.get(node, ()):
            if state.get(e.target) == "open":
                found.append(path[path.index(e.target):] + [e.target])
            elif e.target not in state:
                walk(e.target)
        path.pop()
        state[node] = "done"

    for name in sorted(g):
        if name not in state:
            walk(name)
    return found


def violations(modules: dict) -> list:
    """Every edge against the layer table, and every DSL or torch import where the layer
    forbids it, as readable lines."""
    g, outside = graph(modules)
    bad = []
    for name, found in g.items():
        layer = layer_of(name)
        for e in found:
            target = layer_of(e.target)
            if target in ALLOWED[layer]:
                continue
            if e.by_name and target in BY_NAME.get(layer, ()):
                continue
            bad.append(f"{name} [{layer}] imports {e!r} [{target}]")
        for root, func in outside[name]:
            if root in DSL_ROOTS and name != JIT and not (name in DSL_LAZY and func) and (
                    layer in DSL_NEVER or (func is None and layer not in DSL_AT_MODULE_LEVEL)):
                bad.append(f"{name} [{layer}] imports {root} ({func or 'module level'})")
            if root == DYNAMIC_IMPORT and name not in DYNAMIC:
                bad.append(f"{name} [{layer}] imports a computed module name "
                           f"({func or 'module level'})")
            if root == "torch" and layer in NO_TORCH:
                bad.append(f"{name} [{layer}] imports torch ({func or 'module level'})")
    for cycle in cycles(g):
        bad.append("import cycle: " + " -> ".join(cycle))
    return bad


def installed_packages() -> set:
    """The packages pyproject.toml installs."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def package_folders() -> set:
    """Every folder of the sources that holds an __init__.py, as an installed package name."""
    out = set()
    for package, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            out.add(".".join([package, *parts]))
    return out
