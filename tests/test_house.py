"""The package's shape, read from its source: the size of its rooms and the arrows between its folders.

Sizes count code, not documentation: a module, class or function's lines less its docstrings (the docstring
rules of ``tests/test_docstrings.py`` add lines that say why, and must not force a split). Arrows are the
imports that run (``if TYPE_CHECKING:`` blocks excluded), at module level or inside functions alike.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import plug_asgd

PACKAGE = Path(plug_asgd.__file__).resolve().parent
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 400, 300, 60
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")
# who may import Lightning: the strategy, the callbacks, the namespace files (and the recipes, which are the
# library's users: LightningModules and DataModules written as a user writes them)
KNOWS_LIGHTNING = ("strategy", "callbacks", "lightning_bridge", "lightning", "pytorch_lightning", "recipes")
# the folders below the strategy, and what each may import of the package
MAY_IMPORT = {
    "protocol": set(),
    "compressors": {"protocol", "registry"},
    "modes": {"protocol", "compressors", "registry"},
    "ps": {"protocol", "compressors", "modes"},
    "worker": {"protocol", "compressors", "modes"},
    "sharding": {"protocol", "compressors", "modes", "worker"},
    "cli": {"protocol", "ps", "worker", "startup"},  # startup.py: the standard library's gc alone
    "placement": {"protocol", "compressors", "modes", "ps", "worker", "sharding"},
    "callbacks": {"protocol", "compressors", "modes", "ps", "worker", "sharding", "placement", "lightning_bridge"},
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _room(module: str) -> str:
    """``plug_asgd.ps.server`` -> ``ps``; ``plug_asgd.strategy`` -> ``strategy``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _code_lines(node: ast.AST, docs: set[int]) -> int:
    return sum(1 for n in range(node.lineno, node.end_lineno + 1) if n not in docs)


def _runtime_imports(tree: ast.Module, module: str) -> Iterator[str]:
    """The modules ``tree`` imports when it runs (relative imports resolved; TYPE_CHECKING blocks skipped)."""
    def visit(node: ast.AST) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (m for s in child.orelse for m in visit(ast.Module(body=[s], type_ignores=[])))
                continue
            if isinstance(child, ast.Import):
                yield from (a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(module.split(".")[:-child.level] + ([base] if base else []))
                yield base
                yield from (f"{base}.{a.name}" for a in child.names)
            yield from visit(child)

    yield from visit(tree)


def _graph() -> dict[str, set[str]]:
    names = {_name(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        module = _name(path)
        graph[module] = {m for m in _runtime_imports(ast.parse(path.read_text()), module)
                         if m in names and m != module}
    return graph


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_class_or_function_is_over_its_size(path: Path) -> None:
    tree = ast.parse(path.read_text())
    docs = _docstring_lines(tree)
    total = len(path.read_text().splitlines()) - len(docs)
    too_big = [f"the module: {total} lines"] if total > MODULE_LINES else []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _code_lines(node, docs) > CLASS_LINES:
            too_big.append(f"class {node.name}: {_code_lines(node, docs)} lines")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node, docs) > FUNCTION_LINES:
            too_big.append(f"function {node.name}: {_code_lines(node, docs)} lines")
    assert not too_big, f"{path.relative_to(PACKAGE)}: {too_big}"


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            # a package's __init__ importing its own modules is how a package exports: not a cycle of rooms
            if other.startswith(module + "."):
                continue
            if state.get(other) == 1:
                cycles.append(path[path.index(other):] + [other] if other in path else [module, other])
            elif other not in state:
                walk(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_each_folder_imports_only_the_folders_below_it() -> None:
    wrong = []
    for module, imported in _graph().items():
        room = _room(module)
        if room not in MAY_IMPORT:
            continue
        for other in imported:
            if _room(other) not in MAY_IMPORT[room] | {room, "__init__"}:
                wrong.append(f"{module} imports {other}")
    assert not sorted(wrong), "\n".join(sorted(wrong))


def test_only_the_strategy_the_callbacks_and_the_namespace_files_know_lightning() -> None:
    knowing = []
    for path in _modules():
        module = _name(path)
        imports = set(_runtime_imports(ast.parse(path.read_text()), module))
        if any(m.split(".")[0] in LIGHTNING for m in imports) and _room(module) not in KNOWS_LIGHTNING:
            knowing.append(module)
    assert not knowing, knowing


def test_the_callbacks_are_handed_the_ps_and_import_no_strategy() -> None:
    graph = _graph()
    offenders = sorted(m for m, imported in graph.items() if _room(m) == "callbacks"
                       and any(_room(o) == "strategy" for o in imported))
    assert not offenders, offenders


def test_the_size_counter_leaves_out_docstrings_only() -> None:
    source = 'def f(x):\n    """Doc\n\n    Args:\n        x: a thing.\n    """\n    # a comment\n    return x\n'
    tree = ast.parse(source)
    docs = _docstring_lines(tree)
    assert docs == {2, 3, 4, 5, 6} and _code_lines(tree.body[0], docs) == 3
    assert set(_runtime_imports(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                                          "else:\n    import b\nimport c\n"), "m")) == {"typing",
                                                                                       "typing.TYPE_CHECKING", "b",
                                                                                       "c"}
