"""sample_many(progress=True): one tqdm.auto bar with done/total, retries and failures."""

from __future__ import annotations

from typing import Any

from lora_sampler import RetryPolicy, SamplerClient
from lora_sampler.testing import FakeEngine


def test_progress_bar_counts_done_total_retries_and_failures(engine: FakeEngine, capsys: Any, no_waits: None) -> None:
    """The bar's last state names 4/4 requests, the retries of a transport fault and the one failure."""
    engine.inject_fault("drop", count=1)  # one dropped connection: a retry for that base-model request
    engine.inject_fault("status", count=1, status=400, message="bad")  # then one failure, raised at once
    requests = [{"prompt": f"p{i}", "base_model": engine.model} for i in range(4)]
    with SamplerClient(engine.url, max_workers=1, retry=RetryPolicy(max_attempts=3)) as client:
        results = client.sample_many(requests, progress=True, return_exceptions=True)
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert sum(isinstance(r, Exception) for r in results) == 1
    assert "4/4" in last and "retries=1" in last and "failed=1" in last, err


def test_progress_bar_total_comes_from_the_length_hint(engine: FakeEngine, capsys: Any) -> None:
    """A range-like input gives the total; a generator gives a count without one."""
    with SamplerClient(engine.url, max_workers=2) as client:
        client.sample_many(({"prompt": "x", "base_model": engine.model} for _ in range(3)), progress=True)
        assert "3req" in capsys.readouterr().err.replace(" ", "")
        client.sample_many([{"prompt": "x", "base_model": engine.model}] * 3, progress=True)
        assert "3/3" in capsys.readouterr().err
