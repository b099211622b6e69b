"""The Python examples of the README and of the documentation (docs/**/*.md) run as written, on the test engine.

Every ```python block runs in a fresh folder, in order, except those marked ``<!-- readme-test: skip (why) -->``
or ``<!-- docs-test: skip (why) -->`` on the line before (a vLLM, Ray, a router or object storage; the reason says
which tox env runs the same calls). A self-contained block brings its own engine; a fragment that continues an
earlier example (``client.publish(...)`` alone) finds the names it uses already bound: ``client`` on a FakeEngine
with ``lora_base_dir="loras"``, ``engine``, ``prompt``, ``prompts`` and ``requests``, and the checkpoints
``runs/exp1/step-400.tar.gz`` and ``step-500.tar.gz``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from lora_sampler import SamplerClient
from lora_sampler.testing import FakeEngine, write_adapter_archive

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Every Markdown file whose examples must run: the README, then each documentation page.
MARKDOWN_FILES = [README, *sorted(DOCS.rglob("*.md"))]
_BLOCK = re.compile(r"^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
_SKIP = re.compile(r"<!-- (?:readme|docs)-test: skip \((?P<why>.*)\) -->\s*$")


def python_blocks(files: Sequence[Path]) -> List[Tuple[str, str, str]]:
    """Return ``("path:line", code, skip reason or "")`` for every Python block of ``files``."""
    blocks = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = _SKIP.search(before)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            blocks.append((where, textwrap.dedent(match.group("code")), skip.group("why") if skip else ""))
    return blocks


BLOCKS = python_blocks(MARKDOWN_FILES)


def test_readme_has_the_examples_it_promises() -> None:
    """The README holds its runnable examples (a parse that found none would pass every case below)."""
    runnable = [code for where, code, why in BLOCKS if where.startswith("README.md:") and not why]
    assert len(runnable) >= 3 and any("FakeEngine" in code for code in runnable)


def test_docs_have_the_examples_they_promise() -> None:
    """Each guide that shows Python has at least one example that runs, and the getting-started page runs its own."""
    assert DOCS.is_dir(), DOCS
    runnable = {where.rsplit(":", 1)[0] for where, _, why in BLOCKS if not why}
    for page in ("getting-started", "sampling", "retries", "scoring", "sweeps", "testing", "notebooks"):
        assert any(Path(where).stem == page for where in runnable), f"no runnable example in docs/**/{page}.md"


def test_every_skip_names_its_reason() -> None:
    """A skipped example says why (and so where it runs instead); an empty reason is a mistake, not a skip."""
    for path in MARKDOWN_FILES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "-test: skip" in line:
                match = _SKIP.search(line)
                assert match and match.group("why").strip(), f"{path.relative_to(ROOT)}:{number}: {line!r}"


@pytest.mark.parametrize(("where", "code", "why"), BLOCKS, ids=[where for where, _, _ in BLOCKS])
def test_markdown_example_runs(where: str, code: str, why: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A README or docs example runs without an error against a FakeEngine (or is marked with why it cannot)."""
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)
    with FakeEngine(lora_dir="loras") as engine, SamplerClient(engine.url, lora_base_dir="loras") as client:
        for step in ("step-400", "step-500"):
            write_adapter_archive(f"runs/exp1/{step}.tar.gz", engine.model)
        names: Dict[str, Any] = {
            "__name__": "markdown_example",
            "client": client,
            "engine": engine,
            "prompt": "Once upon a time",
            "prompts": ["a", "b"],
            "requests": [{"prompt": "a", "base_model": engine.model}],
        }
        exec(compile(code, where, "exec"), names)
