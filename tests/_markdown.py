"""The code examples of the README and of the documentation pages, read from their Markdown.

A fenced block runs as written, in the default test suite, unless the line before it says otherwise:

* ``<!-- docs-test: skip (why) -->`` (or ``readme-test:``): not run; the reason says what it needs and where the
  same calls are tested instead;
* ``<!-- docs-test: tox -e NAME -->``: run by the tests of that tox env, which has the service it needs (a store,
  Ray, a router), with the names it uses bound there.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Every Markdown file whose examples must run: the README, then each documentation page.
MARKDOWN_FILES = [README, *sorted(DOCS.rglob("*.md"))]

_BLOCK = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[a-z]+)\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
_SKIP = re.compile(r"<!-- (?:readme|docs)-test: skip \((?P<why>.*)\) -->\s*$")
_ENV = re.compile(r"<!-- docs-test: tox -e (?P<env>[a-z0-9]+) -->\s*$")


@dataclass(frozen=True)
class Example:
    """One fenced code block of a Markdown file.

    Attributes:
        where: ``path:line`` of the opening fence, relative to the repository root (the test id).
        lang: The fence's language (``python``, ``bash``, ...).
        code: The block's text, dedented.
        skip: Why it is not run, or "".
        env: The tox env whose tests run it, or "" for the default suite.
    """

    where: str
    lang: str
    code: str
    skip: str = ""
    env: str = ""


def examples(lang: str, files: Sequence[Path] = MARKDOWN_FILES) -> List[Example]:
    """Return every ``lang`` block of ``files``, in order, with its marker."""
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            if match.group("lang") != lang:
                continue
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip, env = _SKIP.search(before), _ENV.search(before)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            code = textwrap.dedent(match.group("code"))
            found.append(Example(where, lang, code, skip.group("why") if skip else "", env.group("env") if env else ""))
    return found


def marker_problems(files: Sequence[Path] = MARKDOWN_FILES) -> List[str]:
    """Return each test marker that is malformed (an empty reason, an unknown form), as ``path:line: text``."""
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "-test:" in line and "<!--" in line:
                skip, env = _SKIP.search(line), _ENV.search(line)
                if not (env or (skip and skip.group("why").strip())):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return problems
