"""The examples of docs/guides/tinker.md run as written, on FakeEngine, in ``tox -e tinker``.

They are the blocks marked ``<!-- docs-test: tox -e tinker -->`` (see ``tests/_markdown.py``); the default suite skips
them. Each runs in a fresh folder holding ``runs/exp1/step-100`` and ``step-200`` (adapter folders), with
``base_url`` (a FakeEngine) and ``lora_base_dir`` bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
from _markdown import examples

from lora_sampler.testing import FakeEngine, write_adapter

BLOCKS = [block for block in examples("python") if block.env == "tinker"]


def test_the_tinker_guide_has_examples_for_this_env() -> None:
    """A marker typo would leave this file running none."""
    assert len([block for block in BLOCKS if block.where.startswith("docs/guides/tinker.md")]) >= 4


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_tinker_docs_example_runs(block: Any, tinker: Any, tmp_path: Path, monkeypatch: Any) -> None:
    if "tinker_cookbook" in block.code:
        from _services import require

        require("tinker_cookbook", "tox -e tinker installs tinker-cookbook==0.6.1 with --no-deps; it could not")
    monkeypatch.chdir(tmp_path)
    with FakeEngine(lora_dir="loras") as engine:
        for step in ("step-100", "step-200"):
            write_adapter(f"runs/exp1/{step}", engine.model)
        names: Dict[str, Any] = {"__name__": "tinker_example", "base_url": engine.url, "lora_base_dir": "loras"}
        exec(compile(block.code, block.where, "exec"), names)
        assert engine.calls("/v1/completions") > 0  # the example reached the engine
