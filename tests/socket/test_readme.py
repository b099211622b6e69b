"""The Python examples of the README and of the documentation (docs/**/*.md) run as written, on the test engine.

Every ```python block runs in a fresh folder, in order, except those marked on the line before (see
``tests/_markdown.py``): ``<!-- docs-test: skip (why) -->`` (a vLLM, an install; the reason says where the same
calls run) or ``<!-- docs-test: tox -e NAME -->`` (run by that env's tests, which have the service). A
self-contained block brings its own engine; a fragment that continues an earlier example (``client.publish(...)``
alone) finds the names it uses already bound: ``client`` on a FakeEngine with ``lora_base_dir="loras"``,
``engine``, ``prompt``, ``prompts`` and ``requests``, and the checkpoints ``runs/exp1/step-400.tar.gz`` and
``step-500.tar.gz``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
from _markdown import DOCS, examples, marker_problems

from lora_sampler import SamplerClient
from lora_sampler.testing import FakeEngine, write_adapter_archive

BLOCKS = examples("python")


def test_readme_has_the_examples_it_promises() -> None:
    """The README holds its runnable examples (a parse that found none would pass every case below)."""
    runnable = [block for block in BLOCKS if block.where.startswith("README.md:") and not (block.skip or block.env)]
    assert runnable and any("FakeEngine" in block.code for block in runnable)


def test_docs_have_the_examples_they_promise() -> None:
    """Each guide that shows Python has at least one example that runs here, the getting-started page included."""
    assert DOCS.is_dir(), DOCS
    runnable = {Path(block.where.rsplit(":", 1)[0]).stem for block in BLOCKS if not (block.skip or block.env)}
    for page in ("getting-started", "sampling", "retries", "scoring", "sweeps", "testing", "notebooks"):
        assert page in runnable, f"no runnable example in docs/**/{page}.md"


def test_every_marker_is_well_formed() -> None:
    """A skipped example says why (and so where it runs instead); a marker this suite cannot read is a mistake."""
    assert marker_problems() == []


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_markdown_example_runs(block: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """A README or docs example runs without an error against a FakeEngine (or is marked with why it cannot)."""
    if block.skip:
        pytest.skip(block.skip)
    if block.env:
        pytest.skip(f"runs in tox -e {block.env}")
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
        exec(compile(block.code, block.where, "exec"), names)
