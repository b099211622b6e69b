"""The repository cites no document a user or contributor cannot open: the team's planning notes stay out.

Every behaviour the code relies on is explained where it is used, or in the project's own documentation (docs/).
A citation of an unpublished note (its section sign, its file name, or a path to the folder beside the checkout
that held it) is a dead end for a reader, so this test fails on any, in every source, test, documentation and
setup file; only the changelog's released history may mention the past.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
#: The forms a citation took (spelled in pieces, so that this file does not cite them itself).
CITATION = re.compile("SP" "EC( §|\\b)|FIND" "INGS|ROU" "TER\\.md|\\.\\./sha" "red")
SUFFIXES = {".py", ".md", ".cfg", ".ini", ".toml"}
#: Folders that are not the project's own files: tool caches, builds, virtual environments.
SKIPPED = {
    ".git",
    ".tox",
    ".venv",
    "venv",
    "build",
    "dist",
    "site",
    "node_modules",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "__pycache__",
}


def project_files() -> List[Path]:
    """Every file of the checkout with a checked suffix, outside tool and build folders (never walked into: a
    checkout's .tox alone holds tens of thousands of files)."""
    found = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED and not name.endswith(".egg-info")]
        found += [Path(folder, name) for name in names if Path(name).suffix in SUFFIXES]
    return sorted(found)


def test_no_file_cites_an_unpublished_note() -> None:
    """No source, test, documentation or setup file cites the team's planning notes."""
    files = project_files()
    assert any(path.name == "README.md" for path in files) and len(files) > 50, "the walk found too few files"
    citations = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.name == "CHANGELOG.md":  # its released history may name the past; "Unreleased" may not
            text = re.split(r"^## \[(?!Unreleased)", text, maxsplit=1, flags=re.M)[0]
        for number, line in enumerate(text.splitlines(), 1):
            if CITATION.search(line):
                citations.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert citations == [], "explain in place, or link the project's docs instead:\n" + "\n".join(citations)
