"""docs/architecture.md's "Where each behaviour lives": every file it names exists and holds the names of its row.

The table tells a maintainer which files (at most three) to read to be sure of one everyday behaviour. When code
moves, this test names the row and the path or name that went, so the table moves with it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Where each behaviour lives"
#: The most files a maintainer should need to read to be sure of one behaviour.
MAX_FILES = 3


def rows() -> List[Tuple[str, List[str], List[str]]]:
    """``(behaviour, files, names)`` of each row of the table."""
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"{DOC.relative_to(ROOT)} lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("behaviour", "---"):
            continue
        found.append((cells[0], re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", cells[2])))
    return found


def defined_names(path: Path) -> Set[str]:
    """The module-level functions, classes and assignments of one file, and ``Class.method`` for its methods."""
    names: Set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


ROWS = rows()


def test_the_table_has_the_everyday_behaviours() -> None:
    """The behaviours the issue named are all there (more may be)."""
    behaviours = " ".join(behaviour for behaviour, _, _ in ROWS)
    for behaviour in (
        "retry table",
        "an answer becoming a result or an error",
        "publishing a checkpoint",
        "from a store",
        "resume after a kill",
        "outage hold",
        "a sweep's scheduling",
        "split per prompt",
        "scoring isolation",
        "adapter-folder lease",
    ):
        assert behaviour in behaviours, f"{DOC.relative_to(ROOT)}: no row for {behaviour!r}"


@pytest.mark.parametrize(("behaviour", "files", "names"), ROWS, ids=[row[0][:40] for row in ROWS])
def test_each_row_names_files_and_names_that_exist(behaviour: str, files: List[str], names: List[str]) -> None:
    """At most three files, each present, and each name defined in one of them."""
    where = f"{DOC.relative_to(ROOT)}, row {behaviour!r}"
    assert 1 <= len(files) <= MAX_FILES, f"{where}: read {len(files)} files; name at most {MAX_FILES}"
    assert names, f"{where}: name the functions or classes to read"
    defined: Dict[str, Set[str]] = {}
    for file in files:
        path = ROOT / file
        assert path.is_file(), f"{where}: {file} does not exist any more; update the row to where its code moved"
        defined[file] = defined_names(path)
    for name in names:
        assert any(
            name in found for found in defined.values()
        ), f"{where}: {name} is defined in none of {', '.join(files)}; update the row to its new name or file"
