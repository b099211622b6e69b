"""``lora-sampler sweep --evaluator module:factory``: metrics per checkpoint in sweep.jsonl, the table and --plot.

Fails on a1a82fa, where ``--input`` was required and ``--evaluator`` unknown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, List

import pytest
from _services import require

from lora_sampler.testing import FakeEngine

EVALUATORS = textwrap.dedent("""
    import tinker

    class Length:
        async def __call__(self, sampling_client):
            response = await sampling_client.sample(
                tinker.ModelInput.from_ints([10, 11, 12]), 2, tinker.SamplingParams(max_tokens=3)
            )
            logprobs = await sampling_client.compute_logprobs(tinker.ModelInput.from_ints([10, 11, 12]))
            return {"tokens": sum(len(s.tokens) for s in response.sequences), "nll": -sum(logprobs[1:])}

    def make():
        return Length()

    def broken():
        raise RuntimeError("no grader configured")
    """)


def run_cli(arguments: List[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "lora_sampler", "sweep", *arguments]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "my_evals.py").write_text(EVALUATORS)
    return tmp_path


def test_sweep_with_an_evaluator_writes_metrics_table_and_plot(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], workdir: Path
) -> None:
    require("matplotlib", "tox -e tinker installs the plot extra")
    common = ["--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", *map(str, checkpoints)]
    done = run_cli([*common, "--evaluator", "my_evals:make", "--output-dir", "out", "--plot", "m.png"], workdir)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (workdir / "out" / "sweep.jsonl").read_text().splitlines()]
    assert [line["metrics"]["tokens"] for line in lines] == [6.0, 6.0, 6.0]
    header = done.stdout.splitlines()[0].split()
    assert header == ["checkpoint", "tokens", "nll", "seconds"]
    assert "step-300" in done.stdout and (workdir / "m.png").stat().st_size > 1000
    assert "tokens 6" in done.stderr  # each checkpoint's line names its metrics


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--input", "x.jsonl"], "not both"),
        (["--score"], "--score scores --input lines"),
        (["--evaluator", "nowhere_at_all:make"], "No module named 'nowhere_at_all'"),
        (["--evaluator", "my_evals:missing"], "has no 'missing'"),
        (["--evaluator", "my_evals"], "module:factory"),
        (["--evaluator", "my_evals:broken"], "RuntimeError: no grader configured"),
    ],
)
def test_evaluator_usage_errors(
    engine: FakeEngine, lora_dir: Path, checkpoints: List[Path], workdir: Path, extra: List[str], words: str
) -> None:
    arguments = ["--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", str(checkpoints[0])]
    if extra[0] != "--evaluator":
        extra = ["--evaluator", "my_evals:make", *extra]
    done = run_cli([*arguments, *extra, "--output-dir", "out"], workdir)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert engine.calls("/v1/completions") == 0


def test_the_table_and_plot_of_a_sampling_sweep_are_unchanged(tmp_path: Path) -> None:
    from lora_sampler.cli._sweep_runner import metric_names, summary_table

    entries: Any = [{"checkpoint": "a/step-1", "rows": 2, "failed": 0, "mean_logprob": -1.0, "seconds": 1.0}]
    assert metric_names(entries) == [] and summary_table(entries).split()[:3] == ["checkpoint", "rows", "failed"]
    with_error: Any = [*entries, {"checkpoint": "b", "error": {"type": "X", "message": "m"}}]
    assert "error: X: m" in summary_table(with_error)
