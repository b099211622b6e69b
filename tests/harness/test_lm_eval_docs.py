"""The lm-eval guide's shell examples marked ``<!-- docs-test: tox -e lmeval -->`` run as written, in ``tox -e lmeval``.

Each runs in the test's folder, which holds what the block names: ``tasks/`` (``tiny_mc`` and the other local tasks of
``conftest.py``, no Hub) and ``step-1.tar.gz`` (a checkpoint of the engine's base model), with ``$URL`` the FakeEngine
and ``$LORAS`` its resolver folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _markdown import examples
from _shell_examples import run_shell_example

from lora_sampler.testing import FakeEngine

BLOCKS = [block for block in examples("bash") if block.env == "lmeval"]


def test_the_lm_eval_guide_has_shell_examples_for_this_env() -> None:
    """A marker typo would leave this file running none."""
    assert any(block.where.startswith("docs/guides/lm-eval.md:") for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_lm_eval_docs_shell_example_runs(
    block: Any, engine: FakeEngine, lora_dir: Path, tasks: Path, checkpoint: str, tmp_path: Path
) -> None:
    """The block exits 0 and lm-eval wrote its results, with a number for the task it ran."""
    run_shell_example(block, tmp_path, engine.url, lora_dir, {**os.environ, "URL": engine.url, "LORAS": str(lora_dir)})
    (written,) = (tmp_path / "out").rglob("results_*.json")
    assert "acc,none" in json.loads(written.read_text())["results"]["tiny_mc"]
