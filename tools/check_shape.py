"""Fail on a function of lora_sampler longer than 60 lines, counted from its first decorator to its last line.

A function that long holds more than one idea; ruff's mccabe check (C901, ``max-complexity`` in pyproject.toml)
holds the branching, this check holds the length, which mccabe does not see (a long straight run of steps). This
reads the source (``ast``, nothing is imported); a nested function counts inside its parent and on its own.

    python tools/check_shape.py [PACKAGE_DIR ...]     (default: lora_sampler)

Exit status 1 and one line per finding (``path:line: name is N lines (limit 60)``) when anything is found; 0
otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple, Union

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


def main(argv: List[str]) -> int:
    """Check the folders named in ``argv`` (default: lora_sampler); print findings; return the exit status."""
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parents[1] / OWN_PACKAGE]
    found = list(findings(roots))
    for path, line, message in found:
        print(f"{path}:{line}: {message}")
    if found:
        print(
            f"{len(found)} function(s) over {MAX_LINES} lines: split each into the steps it takes, one job a function"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
