"""``sweep(client, checkpoints, evaluator=TinkerEvaluator(...))``: any evaluator on every checkpoint, on FakeEngine.

Fails on a1a82fa, where ``sweep`` required ``requests`` and had no ``evaluator``; ``CheckpointReport`` had no
``metrics`` and ``sweep.jsonl`` no ``"metrics"``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import requests

from lora_sampler import SamplerClient, sweep
from lora_sampler.batch import CheckpointReport
from lora_sampler.testing import FakeEngine

EngineFactory = Callable[..., FakeEngine]


def tinker_evaluator(evaluator: Any) -> Any:
    """``TinkerEvaluator(evaluator)``, imported here: collecting this module must not need tinker."""
    from lora_sampler.tinker import TinkerEvaluator

    return TinkerEvaluator(evaluator)


PROMPT = [10, 11, 12, 13]


class NLL:
    """An async evaluator as tinker-cookbook writes them: gathers several calls on the sampling client."""

    def __init__(self) -> None:
        self.seen: List[Any] = []

    async def __call__(self, sampling_client: Any) -> Dict[str, float]:
        import tinker

        self.seen.append(sampling_client)
        model_input = tinker.ModelInput.from_ints(PROMPT)
        logprobs = await asyncio.gather(*[sampling_client.compute_logprobs(model_input) for _ in range(3)])
        response = await sampling_client.sample(model_input, 2, tinker.SamplingParams(max_tokens=3))
        return {"nll": -sum(logprobs[0][1:]), "tokens": float(sum(len(s.tokens) for s in response.sequences))}


def paths(folders: List[Path]) -> List[str]:
    return [str(folder) for folder in folders]


def ledger(output: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (output / "sweep.jsonl").read_text().splitlines()]


def test_an_async_evaluator_runs_on_every_checkpoint(
    tinker: Any, engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    evaluator = NLL()
    output = tmp_path / "out"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(
            sweep(client, str(tmp_path / "run" / "step-*"), evaluator=tinker_evaluator(evaluator), output_dir=output)
        )
        cards = requests.get(f"{engine.url}/v1/models", timeout=30).json()["data"]
        expected = [
            -sum(client.compute_logprobs(PROMPT, adapter=str(path))[1:]) for path in checkpoints  # the same adapters
        ]
    assert [r.step for r in reports] == [100, 200, 300]
    assert [r.metrics["nll"] for r in reports] == pytest.approx(expected, rel=1e-6)
    assert all(r.metrics["tokens"] == 6.0 and r.ok and r.rows == 0 for r in reports)
    assert all(isinstance(seen, tinker.SamplingClient) for seen in evaluator.seen)
    lines = ledger(output)
    assert [line["metrics"] for line in lines] == [r.metrics for r in reports]
    assert CheckpointReport.from_ledger(lines[0]).metrics == reports[0].metrics
    assert [card["id"] for card in cards if card.get("parent")] == []  # each adapter unloaded once evaluated
    assert engine.calls("/v1/unload_lora_adapter") == 3


def test_a_plain_evaluator_and_resume(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    calls: List[str] = []

    def evaluator(sampling_client: Any) -> Dict[str, float]:
        import tinker

        calls.append(repr(sampling_client))
        response = sampling_client.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2))
        return {"length": len(response.result().sequences[0].tokens), "nan": float("nan")}

    output = tmp_path / "out"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        first = list(sweep(client, paths(checkpoints[:2]), evaluator=tinker_evaluator(evaluator), output_dir=output))
        again = list(sweep(client, paths(checkpoints), evaluator=tinker_evaluator(evaluator), output_dir=output))
    assert [r.metrics for r in first] == [{"length": 2.0, "nan": None}] * 2  # JSON has no NaN
    assert len(calls) == 3  # the two finished checkpoints were not evaluated again
    assert [r.resumed for r in again] == [True, True, False]
    assert [line["step"] for line in ledger(output)] == [100, 200, 300]


def test_an_evaluator_failing_on_one_checkpoint_fails_only_that_one(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    async def evaluator(sampling_client: Any) -> Any:
        if "step-200" in repr(sampling_client):
            raise ZeroDivisionError("the grader divided by zero")
        if "step-300" in repr(sampling_client):
            return ["not", "a", "dict"]
        return {"ok": 1}

    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(
            sweep(client, paths(checkpoints), evaluator=tinker_evaluator(evaluator), output_dir=tmp_path / "out")
        )
    assert reports[0].metrics == {"ok": 1.0} and reports[0].ok
    assert reports[1].error == {"type": "ZeroDivisionError", "message": "the grader divided by zero"}
    assert reports[2].error is not None and "must return dict[str, float]" in reports[2].error["message"]


@pytest.mark.parametrize(
    "answer, words",
    [
        ({"a": "1"}, "must be numbers"),
        ({"a": True}, "must be numbers"),
        ({1: 2.0}, "non-empty printable str"),
        ({"a\nb": 1.0}, "printable"),
        ({"": 1.0}, "printable"),
        (None, "NoneType"),
    ],
)
def test_bad_metrics_are_named(answer: Any, words: str) -> None:
    from lora_sampler.batch._evaluator import EvaluatorError, checked_metrics

    with pytest.raises(EvaluatorError, match=words):
        checked_metrics(answer)


def test_requests_and_evaluator_together_or_neither_are_refused(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(TypeError, match="not both"):
            sweep(
                client,
                paths(checkpoints),
                [{"prompt": "x"}],
                evaluator=tinker_evaluator(NLL()),
                output_dir=tmp_path / "o",
            )
        with pytest.raises(TypeError, match="evaluator="):
            sweep(client, paths(checkpoints), output_dir=tmp_path / "o")
        with pytest.raises(TypeError, match="callable"):
            sweep(client, paths(checkpoints), evaluator="nll", output_dir=tmp_path / "o")  # type: ignore[arg-type]
    assert engine.calls("/v1/completions") == 0


def test_an_engine_gone_for_good_stops_the_sweep(
    make_engine: EngineFactory, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    from lora_sampler import RetryPolicy
    from lora_sampler.errors import LoraSamplerError

    engine = make_engine()
    stopped = threading.Event()

    async def evaluator(sampling_client: Any) -> Dict[str, float]:
        import tinker

        if not stopped.is_set():
            stopped.set()
            engine.stop()
        await sampling_client.compute_logprobs(tinker.ModelInput.from_ints(PROMPT))
        return {"x": 1.0}

    quick = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.1)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, retry=quick, timeout=(0.5, 5)) as client:
        with pytest.raises(LoraSamplerError):
            list(sweep(client, paths(checkpoints), evaluator=tinker_evaluator(evaluator), output_dir=tmp_path / "out"))
    assert not (tmp_path / "out" / "sweep.jsonl").exists() or not ledger(tmp_path / "out")


def test_stop_cancels_an_async_evaluator(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    from lora_sampler.batch import Sweep, SweepSettings

    started = threading.Event()

    async def evaluator(sampling_client: Any) -> Dict[str, float]:
        started.set()
        await asyncio.sleep(60)
        return {"never": 1.0}

    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        running = Sweep(
            client,
            paths(checkpoints),
            None,
            SweepSettings(str(tmp_path / "out")),
            evaluator=tinker_evaluator(evaluator),
        )
        reports: List[Any] = []
        runner = threading.Thread(target=lambda: reports.extend(running.run()))
        runner.start()
        assert started.wait(30)
        began = time.monotonic()
        running.stop(0.0)
        runner.join(30)
    assert not runner.is_alive() and time.monotonic() - began < 10
    assert reports == []  # nothing finished: a re-run evaluates every checkpoint


KILLED_SWEEP = textwrap.dedent("""
    import asyncio, sys, tinker
    from lora_sampler import SamplerClient, sweep
    from lora_sampler.tinker import TinkerEvaluator

    async def evaluator(sampling_client):
        await sampling_client.compute_logprobs(tinker.ModelInput.from_ints([10, 11, 12]))
        if "step-200" in repr(sampling_client):
            print("in step-200", flush=True)
            await asyncio.sleep(120)
        return {"ok": 1.0}

    url, lora_dir, output = sys.argv[1:4]
    with SamplerClient(url, lora_base_dir=lora_dir) as client:
        for report in sweep(client, sys.argv[4:], evaluator=TinkerEvaluator(evaluator), output_dir=output):
            print("done", report.step, flush=True)
    """)


def test_a_sweep_killed_mid_evaluator_resumes(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], tmp_path: Path
) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SWEEP)
    output = tmp_path / "out"
    arguments = [sys.executable, str(script), engine.url, str(lora_dir), str(output), *map(str, checkpoints)]
    child = subprocess.Popen(
        arguments, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert child.stdout is not None
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.strip() for line in child.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while not {"done 100", "in step-200"} <= set(lines) and time.monotonic() < deadline:  # in either order
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    reader.join(30)
    assert sorted(lines) == ["done 100", "in step-200"]
    assert [line["step"] for line in ledger(output)] == [100]

    async def evaluator(sampling_client: Any) -> Dict[str, float]:
        return {"ok": 2.0}

    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(sweep(client, paths(checkpoints), evaluator=tinker_evaluator(evaluator), output_dir=output))
    assert [(r.step, r.resumed, r.metrics["ok"]) for r in reports] == [
        (100, True, 1.0),
        (200, False, 2.0),
        (300, False, 2.0),
    ]
    assert [line["step"] for line in ledger(output)] == [100, 200, 300]
