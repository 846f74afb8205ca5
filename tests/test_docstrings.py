"""The package's docstring conventions, read from its source (Google style, as Lightning writes them).

Every public function, class and method of ``plug_asgd`` (a name without a leading underscore, in a module
without one) has a docstring; one that takes arguments names each under ``Args:`` (a dataclass's or named
tuple's fields may stand under ``Attributes:`` instead); one whose own body raises an exception names it under
``Raises:``. A method marked ``@override`` takes its base's docstring and is exempt. The names that
``plug_asgd`` exports also carry an ``Example:``, which ``test_the_exported_names_examples_run`` runs.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import re
from pathlib import Path

import pytest

import plug_asgd

PACKAGE = Path(plug_asgd.__file__).resolve().parent
SECTION = re.compile(r"^\s*(Args|Arguments|Attributes|Raises|Returns|Yields|Example|Examples|Note|Notes):\s*$")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not any(part.startswith("_") and part != "__init__.py"
                                                                for part in p.relative_to(PACKAGE).parts))


def _section(doc: str, name: str) -> list[str]:
    """The lines of section ``name`` (``Args``, ...): those indented under its heading."""
    lines = doc.splitlines()
    out: list[str] = []
    inside, indent = False, 0
    for line in lines:
        heading = SECTION.match(line)
        if heading:
            inside = heading.group(1) in (name, name + "s") or (name == "Args" and heading.group(1) == "Arguments")
            indent = len(line) - len(line.lstrip())
            continue
        if inside:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                inside = False
            else:
                out.append(line)
    return out


def _names_in(section: list[str]) -> set[str]:
    found = set()
    for line in section:
        m = re.match(r"^\s*\**([A-Za-z_][A-Za-z0-9_]*)\s*(\(.*\))?:", line)
        if m:
            found.add(m.group(1))
    return found


def _is_override(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "override") or (isinstance(d, ast.Attribute)
               and d.attr == "override") for d in node.decorator_list)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if a.vararg:
        names.append(a.vararg.arg)
    if a.kwarg:
        names.append(a.kwarg.arg)
    return [n for n in names if n not in ("self", "cls")]


def _raised(fn: ast.AST) -> set[str]:
    """The exceptions ``fn``'s own body raises by name (not its nested functions', not a bare re-raise)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id[:1].isupper():
                    found.add(exc.id)
                elif isinstance(exc, ast.Attribute):
                    found.add(exc.attr)
            visit(child)

    visit(fn)
    return found


def _is_record(cls: ast.ClassDef) -> bool:
    """A dataclass, named tuple, typed dict, enum or protocol: its fields are its arguments."""
    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}
    decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", getattr(getattr(d, "func", None), "id",
                  getattr(getattr(d, "func", None), "attr", ""))) for d in cls.decorator_list}
    return bool(bases & {"NamedTuple", "TypedDict"}) or "dataclass" in decorators


def _fields(cls: ast.ClassDef) -> list[str]:
    return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not s.target.id.startswith("_") and "ClassVar" not in ast.unparse(s.annotation)]


def _problems(where: str, doc: str | None, params: list[str], raised: set[str]) -> list[str]:
    if not doc:
        return [f"{where}: no docstring"]
    out = []
    if params:
        named = _names_in(_section(doc, "Args")) | _names_in(_section(doc, "Attributes"))
        missing = [p for p in params if p not in named]
        if missing:
            out.append(f"{where}: Args: lacks {missing}")
    if raised:
        named = " ".join(_section(doc, "Raises"))
        missing = sorted(e for e in raised if e not in named)
        if missing:
            out.append(f"{where}: Raises: lacks {missing}")
    return out


def _module_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE.parent)
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            out += _problems(f"{rel}:{node.lineno} {node.name}", ast.get_docstring(node), _parameters(node),
                             _raised(node))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            init = next((m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None)
            params = _parameters(init) if init else (_fields(node) if _is_record(node) else [])
            out += _problems(f"{rel}:{node.lineno} {node.name}", ast.get_docstring(node), params,
                             _raised(init) if init else set())
            for m in node.body:
                if (isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_")
                        and not _is_override(m)):
                    out += _problems(f"{rel}:{m.lineno} {node.name}.{m.name}", ast.get_docstring(m),
                                     _parameters(m), _raised(m))
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_public_functions_and_classes_document_their_arguments_and_exceptions(path: Path) -> None:
    problems = _module_problems(path)
    assert not problems, "\n".join(problems)


def _exported() -> list[str]:
    return list(plug_asgd.__all__)


@pytest.mark.parametrize("name", _exported())
def test_the_exported_names_examples_run(name: str) -> None:
    obj = getattr(plug_asgd, name)
    doc = inspect.getdoc(obj) or ""
    assert _section(doc, "Example") and ">>>" in doc, f"plug_asgd.{name} has no Example: with a runnable >>> line"
    module = importlib.import_module(obj.__module__)
    test = doctest.DocTestParser().get_doctest(doc, dict(vars(module)), f"plug_asgd.{name}", obj.__module__, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"plug_asgd.{name}'s example failed (run it: python -m doctest on its module)"


def test_the_parser_reads_args_and_raises_as_google_style_writes_them() -> None:
    doc = """Do a thing.

    Args:
        alpha: the first.
        beta (int): the second,
            over two lines.
        **options: the rest.

    Raises:
        ValueError: where alpha is negative.
    """
    doc = inspect.cleandoc(doc)
    assert _names_in(_section(doc, "Args")) == {"alpha", "beta", "options"}
    assert "ValueError" in " ".join(_section(doc, "Raises"))
    tree = ast.parse("def f(alpha, beta, **options):\n    if alpha < 0:\n        raise ValueError('x')\n"
                     "    def g():\n        raise KeyError('y')\n")
    fn = tree.body[0]
    assert _raised(fn) == {"ValueError"}
    assert _problems("f", doc, _parameters(fn), _raised(fn)) == []
    assert _problems("f", "Do a thing.", _parameters(fn), _raised(fn)) == [
        "f: Args: lacks ['alpha', 'beta', 'options']", "f: Raises: lacks ['ValueError']"]
