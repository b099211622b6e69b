"""``lora_sampler.sweep`` from a notebook: explicit keywords (``sample``'s sampling ones too), typed report fields,
and a re-run that yields the finished checkpoints again from ``sweep.jsonl``, marked as resumed.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _sweeps import make_run

from lora_sampler import SamplerClient, sweep
from lora_sampler.batch import CheckpointReport, LineDefaults, SampleStep
from lora_sampler.testing import FakeEngine
from lora_sampler.types import Adapter, SampleRequest, SamplingParams

SAMPLING_KEYWORDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "extra_body", "prompt_logprobs")


def test_sweep_signature_names_every_option() -> None:
    """No **options: every keyword is named (help and completion show them), sample's sampling keywords included."""
    parameters = inspect.signature(sweep).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name in (*SAMPLING_KEYWORDS, "num_samples", "sampling_params", "window", "watch", "idle_timeout", "score"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert "adapter" not in parameters and "base_model" not in parameters  # the sweep sets them per checkpoint


def test_client_sweep_takes_sampling_keywords(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """sweep(client, max_tokens=3, stop=..., seed=...) as sample takes them: each line is sampled with them."""
    make_run(tmp_path / "run", engine.model, (10,))
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=2) as client:
        reports = list(
            sweep(
                client,
                str(tmp_path / "run" / "*.tar.gz"),
                [{"id": "a", "prompt": [5, 6]}, {"id": "b", "prompt": [7], "max_tokens": 5}],
                output_dir=tmp_path / "out",
                max_tokens=3,
                temperature=0.0,
                seed=7,
            )
        )
    assert [(r.ok, r.rows, r.tokens, r.resumed) for r in reports] == [(True, 2, 8, False)]  # 3 + the line's own 5


def test_client_sweep_refuses_sampling_keywords_with_params_or_scoring(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """Both sampling_params= and max_tokens=, or sampling keywords with score=True: a TypeError before any request."""
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(TypeError, match="not both"):
            sweep(client, "x/*", [], output_dir=tmp_path, sampling_params=SamplingParams(), max_tokens=3)
        with pytest.raises(TypeError, match="sampling only"):
            list(sweep(client, "x/*", [], output_dir=tmp_path, score=True, max_tokens=3))
        with pytest.raises(TypeError, match="needs requests"):
            list(sweep(client, "x/*", output_dir=tmp_path))
    assert engine.requests == []


def test_sweep_extra_body_reaches_every_line() -> None:
    """extra_body= (--extra-body) goes into every request; a line's own extra_body object overrides its keys."""
    adapter = Adapter("step-1-abc", "/x/step-1-abc")
    step = SampleStep(
        [{"id": 1, "prompt": [5]}, {"id": 2, "prompt": [5], "extra_body": {"min_tokens": 2, "ignore_eos": True}}],
        LineDefaults(extra_body={"min_tokens": 1, "repetition_penalty": 1.1}),
    )
    bodies = [line.request.extra_body for line in step.lines(adapter) if isinstance(line.request, SampleRequest)]
    assert bodies == [
        {"min_tokens": 1, "repetition_penalty": 1.1},
        {"min_tokens": 2, "repetition_penalty": 1.1, "ignore_eos": True},
    ]
    bad = list(SampleStep([{"id": 1, "prompt": [5], "extra_body": {"n": 3}}]).lines(adapter))
    assert bad[0].request is None and "num_samples=" in bad[0].error  # a field the request sets itself


def test_report_mean_sum_is_typed_and_old_ledger_lines_read_back() -> None:
    """mean_sum is a field (ledger key unchanged); a line without the newer keys reads back; resumed is not written."""
    old: Dict[str, Any] = {"checkpoint": "/r/step-1.tar.gz", "adapter": "step-1-a", "output": "step-1-a.jsonl"}
    old.update(rows=2, failed=0, tokens=4, mean_logprob=-1.0, mean_length=2.0, seconds=0.5, step=1)
    report = CheckpointReport.from_ledger(old)
    assert report.mean_sum is None and report.extra == {} and not report.resumed
    assert report.ledger_line() == old  # no null mean_sum appears
    scored = CheckpointReport.from_ledger({**old, "mean_sum": -3.5, "future_key": [1]}, resumed=True)
    assert (scored.mean_sum, scored.resumed, scored.extra) == (-3.5, True, {"future_key": [1]})
    line = scored.ledger_line()
    assert line["mean_sum"] == -3.5 and "resumed" not in line and "extra" not in line
    assert json.loads(json.dumps(line)) == {**old, "mean_sum": -3.5, "future_key": [1]}


def test_rerun_of_a_finished_sweep_yields_its_reports_again(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """A notebook cell run twice: the second run sends nothing and yields the same reports, marked resumed."""
    make_run(tmp_path / "run", engine.model, (10, 20))
    requests: List[Any] = [{"id": "a", "prompt": [5, 6]}]
    pattern = str(tmp_path / "run" / "*.tar.gz")
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        first = list(sweep(client, pattern, requests, output_dir=tmp_path / "out", max_tokens=2))
        engine.reset_log()
        again = list(sweep(client, pattern, requests, output_dir=tmp_path / "out", max_tokens=2))
    assert engine.calls("/v1/completions") == 0
    assert [r.resumed for r in again] == [True, True] and not any(r.resumed for r in first)
    assert sorted(r.ledger_line()["checkpoint"] for r in again) == sorted(r.checkpoint for r in first)
    assert {r.checkpoint: (r.rows, r.mean_logprob) for r in again} == {
        r.checkpoint: (r.rows, r.mean_logprob) for r in first
    }
