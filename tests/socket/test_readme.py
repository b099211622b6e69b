"""The README's Python examples run as written, against the built-in test engine.

Every ```python block runs in a fresh folder, in order, except those marked ``<!-- readme-test: skip (why) -->``
(a vLLM, Ray, a router or object storage). A self-contained block brings its own engine; a fragment that continues
an earlier example (``client.publish(...)`` alone) finds the names it uses already bound: ``client`` on a
FakeEngine with ``lora_base_dir="loras"``, ``engine``, ``prompt``, ``prompts`` and ``requests``, and the
checkpoints ``runs/exp1/step-400.tar.gz`` and ``step-500.tar.gz``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from lora_sampler import SamplerClient
from lora_sampler.testing import FakeEngine, write_adapter_archive

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
_SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]*)\) -->\s*$")


def readme_blocks() -> List[Tuple[int, str, str]]:
    """Return ``(line, code, skip reason or "")`` for every Python block of the README."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, textwrap.dedent(match.group("code")), skip.group("why") if skip else ""))
    return blocks


BLOCKS = readme_blocks()


def test_readme_has_the_examples_it_promises() -> None:
    """The README holds its runnable examples (a parse that found none would pass every case below)."""
    runnable = [code for _, code, why in BLOCKS if not why]
    assert len(runnable) >= 6 and any("write_adapter_archive" in code for code in runnable)


@pytest.mark.parametrize(("line", "code", "why"), BLOCKS, ids=[f"line-{line}" for line, _, _ in BLOCKS])
def test_readme_example_runs(line: int, code: str, why: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A README example runs without an error against a FakeEngine (or is marked with why it cannot)."""
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)
    with FakeEngine(lora_dir="loras") as engine, SamplerClient(engine.url, lora_base_dir="loras") as client:
        for step in ("step-400", "step-500"):
            write_adapter_archive(f"runs/exp1/{step}.tar.gz", engine.model)
        names: Dict[str, Any] = {
            "__name__": "readme_example",
            "client": client,
            "engine": engine,
            "prompt": "Once upon a time",
            "prompts": ["a", "b"],
            "requests": [{"prompt": "a", "base_model": engine.model}],
        }
        exec(compile(code, f"README.md:{line}", "exec"), names)
