"""The sweep's evaluator seam needs no evaluation library: a ``CheckpointEvaluator`` is handed the sweep's client and
the checkpoint's adapter, and returns metrics (``lora_sampler.tinker.TinkerEvaluator`` is one such wrapper; an
lm-eval one plugs in the same way). These run with ``tinker`` and ``lora_sampler.tinker`` made unimportable."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _sweeps import make_run, sweep_args

from lora_sampler import SamplerClient, sweep
from lora_sampler.batch import CheckpointEvaluator, EvaluatedCheckpoint, EvaluatorError
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine


class OwnEvaluator(CheckpointEvaluator):
    """Samples one prompt under the checkpoint's adapter through the sweep's client; its metric is the token count."""

    def __init__(self) -> None:
        self.seen: List[str] = []

    def __call__(self, checkpoint: EvaluatedCheckpoint) -> Dict[str, float]:
        self.seen.append(checkpoint.adapter.name)
        output = checkpoint.client.sample([5, 6, 7], adapter=checkpoint.adapter, max_tokens=3)
        return {"tokens": float(len(output.sequences[0].tokens))}


def make() -> OwnEvaluator:
    """The ``--evaluator`` factory of these tests (``test_sweep_evaluator_seam:make``)."""
    return OwnEvaluator()


@pytest.fixture
def without_tinker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing ``tinker`` or ``lora_sampler.tinker`` fails, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "tinker", None)
    monkeypatch.setitem(sys.modules, "lora_sampler.tinker", None)


def test_an_evaluator_of_its_own_runs_on_every_checkpoint_without_tinker(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, without_tinker: None
) -> None:
    make_run(tmp_path / "run", engine.model, (10, 20))
    evaluator = OwnEvaluator()
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(
            sweep(client, str(tmp_path / "run" / "*.tar.gz"), evaluator=evaluator, output_dir=tmp_path / "o")
        )
    assert [(r.step, r.metrics) for r in reports] == [(10, {"tokens": 3.0}), (20, {"tokens": 3.0})]
    assert evaluator.seen == [r.adapter for r in reports]


def test_the_command_line_runs_a_factory_s_own_evaluator_without_tinker(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, without_tinker: None, capsys: Any
) -> None:
    make_run(tmp_path / "run", engine.model, (10,))
    argv = sweep_args(
        engine, lora_dir, tmp_path / "unused", tmp_path / "o", "--checkpoints", str(tmp_path / "run" / "*")
    )
    at = argv.index("--input")
    del argv[at : at + 2]
    assert main([*argv, "--evaluator", "test_sweep_evaluator_seam:make"]) == 0, capsys.readouterr().err
    ledger = [json.loads(line) for line in (tmp_path / "o" / "sweep.jsonl").read_text().splitlines()]
    assert [line["metrics"] for line in ledger] == [{"tokens": 3.0}]


def test_a_plain_callable_is_told_to_wrap_itself(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """A callable taking a Tinker sampling client (what evaluator= took before): the error names the wrapper."""
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(EvaluatorError, match=r"lora_sampler\.tinker\.TinkerEvaluator\(evaluator\)"):
            sweep(client, str(tmp_path / "*"), evaluator=lambda sampling_client: {}, output_dir=tmp_path / "o")
    assert engine.calls("/v1/completions") == 0
