"""Fail on a function of lora_sampler longer than 60 lines, counted from its first decorator to its last line, and
on an import circle between its modules.

A function that long holds more than one idea; ruff's mccabe check (C901, ``max-complexity`` in pyproject.toml)
holds the branching, this check holds the length, which mccabe does not see (a long straight run of steps). This
reads the source (``ast``, nothing is imported); a nested function counts inside its parent and on its own.

    python tools/check_shape.py [PACKAGE_DIR ...]     (default: lora_sampler)

An import circle (``a`` imports ``b`` and ``b`` imports ``a``, directly or through others) counts every import
statement, those under ``if TYPE_CHECKING:`` and inside functions included: it is broken by putting the shared piece
in the lower module, or by a ``Protocol`` there describing what it needs of the higher one.

Exit status 1 and one line per finding (``path:line: name is N lines (limit 60)``, ``path:line: import circle:
a -> b -> a``) when anything is found; 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

#: The longest a function may be, in lines from its first decorator to its end.
MAX_LINES = 60
#: The package checked when no folder is named.
OWN_PACKAGE = "lora_sampler"

Function = Union[ast.FunctionDef, ast.AsyncFunctionDef]


def python_files(roots: Iterable[Path]) -> List[Path]:
    """Every ``.py`` file under ``roots``, sorted."""
    return sorted(path for root in roots for path in ([root] if root.is_file() else root.rglob("*.py")))


def function_lengths(tree: ast.Module) -> Iterator[Tuple[int, str, int]]:
    """Yield ``(first line, name, lines)`` for every function and method in one module, decorators included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            last = node.end_lineno or node.lineno
            yield first, node.name, last - first + 1


def findings(paths: Iterable[Path], limit: int = MAX_LINES) -> Iterator[Tuple[Path, int, str]]:
    """Yield ``(path, line, message)`` for each function over ``limit`` lines under ``paths``."""
    for path in python_files(paths):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for line, name, length in sorted(function_lengths(tree)):
            if length > limit:
                yield path, line, f"{name} is {length} lines (limit {limit})"


def module_name(path: Path, package: Path) -> str:
    """The dotted name of the module at ``path`` in ``package`` (a folder with ``__init__.py``)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.Module, name: str, is_package: bool, modules: Set[str]) -> Iterator[Tuple[str, int]]:
    """Yield ``(module, line)`` for each import of a module in ``modules`` by the module ``name``: ``from m import x``
    imports ``m.x`` when that is a module, else ``m``."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            parent = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                if target in modules:
                    yield target, node.lineno


def import_graph(package: Path) -> Dict[str, Dict[str, Tuple[Path, int]]]:
    """Map each module of ``package`` to the modules of it that it imports, each with where (path, first line)."""
    paths = {module_name(path, package): path for path in python_files([package])}
    graph: Dict[str, Dict[str, Tuple[Path, int]]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges = graph.setdefault(name, {})
        for target, line in imported_modules(tree, name, path.name == "__init__.py", set(paths)):
            if target != name:
                edges.setdefault(target, (path, line))
    return graph


def circle_through(graph: Dict[str, Dict[str, Tuple[Path, int]]], start: str) -> Optional[List[str]]:
    """The shortest import path from ``start`` back to itself (``[start, ..., start]``), or None."""
    came_from: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: List[str] = []
        for module in frontier:
            for target in sorted(graph.get(module, {})):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return None


def import_circles(package: Path) -> Iterator[Tuple[Path, int, str]]:
    """Yield ``(path, line, message)`` for each import circle between the modules of ``package``, once each."""
    graph = import_graph(package)
    reported: Set[str] = set()
    for module in sorted(graph):
        circle = None if module in reported else circle_through(graph, module)
        if circle is not None:
            reported.update(circle)
            path, line = graph[circle[0]][circle[1]]
            yield path, line, "import circle: " + " -> ".join(circle)


def main(argv: List[str]) -> int:
    """Check the folders named in ``argv`` (default: lora_sampler); print findings; return the exit status."""
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parents[1] / OWN_PACKAGE]
    found = list(findings(roots))
    circles = [circle for root in roots if (root / "__init__.py").is_file() for circle in import_circles(root)]
    for path, line, message in found + circles:
        print(f"{path}:{line}: {message}")
    if found:
        print(
            f"{len(found)} function(s) over {MAX_LINES} lines: split each into the steps it takes, one job a function"
        )
    if circles:
        print(
            f"{len(circles)} import circle(s) between modules: put the shared piece in the lower module, or a Protocol "
            "there for what it needs of the higher one (an import under TYPE_CHECKING or in a function counts too)"
        )
    return 1 if found or circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
