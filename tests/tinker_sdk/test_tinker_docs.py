"""The examples of docs/guides/tinker.md run as written, on FakeEngine, in ``tox -e tinker``.

They are the blocks marked ``<!-- docs-test: tox -e tinker -->`` (see ``tests/_markdown.py``); the default suite skips
them. Each runs in a fresh folder holding ``runs/exp1/step-100`` and ``step-200`` (adapter folders): a Python block
with ``base_url`` (a FakeEngine) and ``lora_base_dir`` bound, a shell block on that engine with ``my_evals.py``
beside it (its ``make()`` returns tinker-cookbook's ``SamplerNLLEvaluator``, as the block's comment says).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest
from _markdown import examples
from _shell_examples import run_shell_example

from lora_sampler.testing import FakeEngine, write_adapter

BLOCKS = [block for block in examples("python") if block.env == "tinker"]
SHELL_BLOCKS = [block for block in examples("bash") if block.env == "tinker"]
#: The ``my_evals.py`` the shell example names: ``make()`` returns a held-out NLL evaluator of tinker-cookbook.
MY_EVALS = textwrap.dedent("""
    import numpy as np
    import tinker
    from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator


    def datum(tokens):
        targets = np.array(tokens[1:], dtype=np.int64)
        weights = np.ones(len(targets), dtype=np.float32)
        inputs = {"target_tokens": targets, "weights": weights}
        inputs = {name: tinker.TensorData.from_numpy(array) for name, array in inputs.items()}
        return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


    def make():
        return SamplerNLLEvaluator([datum([10, 11, 12, 13]), datum([20, 21, 22])], name="heldout")
    """)


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


def test_the_tinker_guide_has_a_shell_example_for_this_env() -> None:
    assert [block.where.rsplit(":", 1)[0] for block in SHELL_BLOCKS] == ["docs/guides/tinker.md"]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[block.where for block in SHELL_BLOCKS])
def test_tinker_docs_shell_example_runs(
    block: Any, cookbook: Any, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """The command-line sweep with ``--evaluator my_evals:make`` writes each checkpoint's held-out NLL and the plot."""
    for step in ("step-100", "step-200"):
        write_adapter(tmp_path / "runs" / "exp1" / step, engine.model)
    (tmp_path / "my_evals.py").write_text(MY_EVALS, encoding="utf-8")
    run_shell_example(block, tmp_path, engine.url, lora_dir, dict(os.environ))
    lines = [json.loads(line) for line in (tmp_path / "evals" / "exp1" / "sweep.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["metrics"]["heldout/nll"] > 0 for line in lines)
    assert (tmp_path / "evals" / "exp1" / "nll.png").stat().st_size > 0
