"""Docstrings are Google style as the API reference reads them: one argument per ``Args:`` entry, each named in the
signature, so ``mkdocs build --strict`` (``tox -e docs``) renders every public page without a warning.

The check reads the source (nothing is imported, so optional extras such as tinker need not be installed).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Tuple, Union

PACKAGE = Path(__file__).resolve().parents[2] / "lora_sampler"
_SECTION = re.compile(r"^(?P<indent>[ ]*)(?P<name>Args|Arguments|Parameters|Keyword Args|Other Parameters):[ ]*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}[A-Za-z_][A-Za-z0-9_]*)(?: \([^)]*\))?:(?: |$)")

Documented = Union[ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef]


def documented(tree: ast.Module) -> Iterator[Tuple[Documented, ast.FunctionDef | ast.AsyncFunctionDef | None]]:
    """Yield each class and function with the signature its ``Args:`` describe (a class: its ``__init__``)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node
        elif isinstance(node, ast.ClassDef):
            init = next(
                (item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"), None
            )
            yield node, init


def argument_entries(docstring: str) -> Iterator[Tuple[int, str]]:
    """Yield ``(line offset, entry line)`` for each entry of the docstring's argument sections."""
    lines = docstring.expandtabs().splitlines()
    index = 0
    while index < len(lines):
        section = _SECTION.match(lines[index])
        index += 1
        if not section:
            continue
        entry_indent = None
        while index < len(lines) and (
            not lines[index].strip() or len(lines[index]) - len(lines[index].lstrip()) > len(section.group("indent"))
        ):
            line = lines[index]
            if line.strip():
                indent = len(line) - len(line.lstrip())
                if entry_indent is None:
                    entry_indent = indent
                if indent == entry_indent:
                    yield index, line.strip()
            index += 1


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> List[str]:
    """The names a docstring may describe: every argument, ``*args`` and ``**kwargs`` (with or without stars)."""
    arguments = function.args
    names = [arg.arg for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    for star, arg in (("*", arguments.vararg), ("**", arguments.kwarg)):
        if arg is not None:
            names += [arg.arg, star + arg.arg]
    return names


def problems() -> List[str]:
    """Every argument entry that is not one name of the signature, as ``path:line: why``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, signature in documented(tree):
            docstring = ast.get_docstring(node, clean=True)
            if not docstring or not node.body or not isinstance(node.body[0], ast.Expr):
                continue
            start = node.body[0].lineno
            for offset, entry in argument_entries(docstring):
                where = f"{path.relative_to(PACKAGE.parent)}:{start + offset}"
                match = _ENTRY.match(entry)
                if not match:
                    found.append(f"{where}: not one 'name: description' entry: {entry[:70]!r}")
                elif signature is not None and match.group("name") not in parameters(signature):
                    found.append(f"{where}: {match.group('name')!r} is not an argument of {node.name}")
    return found


def test_argument_entries_name_one_argument_each() -> None:
    """Each ``Args:`` entry is ``name: description`` (or ``name (type): ...``) for one argument of the signature."""
    assert problems() == []
