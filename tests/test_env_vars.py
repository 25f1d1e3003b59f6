"""The README's environment-variable table against the code: every variable the package reads
(`os.environ.get`, `os.getenv`, `os.environ[...]`, `... in os.environ`, found by AST, names
resolved through module-level string constants) is listed, and nothing else is."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("flash_cute", "arch") for p in (ROOT / d).rglob("*.py")]


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _read_names(tree) -> list:
    """The expressions naming a variable the module reads."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)) or \
                    (isinstance(f, ast.Attribute) and f.attr == "getenv"
                     and isinstance(f.value, ast.Name) and f.value.id == "os"):
                out.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and \
                isinstance(node.ctx, ast.Load):
            out.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            out.append(node.left)
    return out


def variables_read() -> set:
    trees = {p: ast.parse(p.read_text()) for p in SOURCES}
    constants = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value
    found = set()
    for path, tree in trees.items():
        for expr in _read_names(tree):
            if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
                found.add(expr.value)
            elif isinstance(expr, ast.Name) and expr.id in constants:
                found.add(constants[expr.id])
            else:
                raise AssertionError(f"{path.relative_to(ROOT)}:{expr.lineno}: an environment "
                                     f"variable read through {ast.unparse(expr)}, not a "
                                     f"string constant")
    return found


def readme_table() -> set:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, flags=re.M):
        names |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", row))
    return names


def test_the_readme_lists_exactly_the_environment_variables_the_code_reads():
    read, listed = variables_read(), readme_table()
    assert "FLASH_CUTE_CACHE_DIR" in read and "CUTE_DSL_ARCH" in read
    assert read == listed, {"read, not listed": read - listed, "listed, not read": listed - read}


def test_the_finder_sees_every_way_of_reading_a_variable(tmp_path):
    """The AST walk on a planted module: get, getenv, subscript, `in`, through a constant."""
    tree = ast.parse("import os\nNAME = 'B'\nos.environ.get('A')\nos.getenv(NAME)\n"
                     "os.environ['C']\n'D' in os.environ\nos.environ['E'] = '1'\n")
    assert {ast.literal_eval(e) if isinstance(e, ast.Constant) else e.id
            for e in _read_names(tree)} == {"A", "NAME", "C", "D"}
