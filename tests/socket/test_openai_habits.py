"""What an OpenAI SDK user reaches for: sampling keywords, extra_body= and timeout= per call, usage, display forms."""

from __future__ import annotations

import json
import math
from typing import Any, Dict

import pytest
from rawserver import RawServer

from lora_sampler import (
    EngineTimeoutError,
    GeneratedSequence,
    RetryPolicy,
    SampleOutput,
    SamplerClient,
    SamplingParams,
)
from lora_sampler.testing import FakeEngine, _bodies
from lora_sampler.types import build_request

ONE_TRY = RetryPolicy(max_attempts=1)


def _completion(model: str) -> bytes:
    choice = _bodies.completion_choice(
        0,
        "ab",
        logprobs={"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"], "text_offset": [0, 1], "top_logprobs": None},
        finish_reason="length",
        token_ids=[7, 8],
        prompt_token_ids=[1, 2, 3],
    )
    return _bodies.json_body(200, _bodies.completion_data("cmpl-1", 1, model, [choice], 3, 2)).body


def _body_sent(**sample_kwargs: Any) -> Dict[str, Any]:
    """Send one base-model sample to a raw server and return the JSON body it received."""
    seen: Dict[str, Any] = {}

    def handler(conn: Any, index: int) -> None:
        body = _completion("base")
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)

    with RawServer(handler) as server:
        with SamplerClient(server.url, retry=ONE_TRY) as client:
            client.sample([1, 2, 3], base_model="base", **sample_kwargs)
        seen.update(json.loads(server.requests[0].split(b"\r\n\r\n", 1)[1]))
    return seen


def test_habits_sampling_keywords_and_extra_body_reach_the_engine() -> None:
    """max_tokens=, temperature=, stop= and extra_body= go into the completion body as the SDK sends them."""
    sent = _body_sent(max_tokens=4, temperature=0, stop=["\n"], extra_body={"repetition_penalty": 1.1})
    assert sent["max_tokens"] == 4 and sent["temperature"] == 0 and sent["stop"] == ["\n"]
    assert sent["repetition_penalty"] == 1.1 and sent["top_p"] == 1.0


def test_habits_sampling_keywords_with_sampling_params_is_a_type_error(engine: FakeEngine) -> None:
    """sampling_params= and a sampling keyword together raise a TypeError naming both ways, before any request."""
    with SamplerClient(engine.url) as client:
        with pytest.raises(TypeError, match=r"either as sampling_params=SamplingParams\(...\) or as keyword"):
            client.sample([1], base_model=engine.model, sampling_params=SamplingParams(), max_tokens=4)
        with pytest.raises(TypeError, match="temperature"):
            client.submit([1], base_model=engine.model, sampling_params=SamplingParams(), temperature=0.5)
        with pytest.raises(TypeError, match=r"unknown request field.*'max_token'"):
            client.submit([1], base_model=engine.model, max_token=4)
    assert engine.calls("/v1/completions") == 0


def test_habits_keywords_in_chat_submit_and_request_mappings(engine: FakeEngine) -> None:
    """chat, submit and the mappings of sample_many take the same keywords, and usage reads the engine's counts."""
    with SamplerClient(engine.url) as client:
        reply = client.chat([{"role": "user", "content": "Hi"}], base_model=engine.model, max_tokens=3, seed=1)
        future = client.submit("Hello", base_model=engine.model, max_tokens=2, temperature=0)
        many = client.sample_many([{"prompt": "a", "base_model": engine.model, "max_tokens": 5}])
        assert len(reply.sequences[0].tokens) == 3 and len(future.result().sequences[0].tokens) == 2
    assert len(many[0].sequences[0].tokens) == 5
    usage = many[0].usage
    assert usage is not None and usage.completion_tokens == 5 and usage.total_tokens == usage.prompt_tokens + 5


def test_habits_timeout_per_call_overrides_the_clients(make_engine: Any) -> None:
    """timeout= on one call bounds that call's attempts; the client's own timeout serves the others."""
    slow = make_engine(latency=1.0)
    with SamplerClient(slow.url, retry=ONE_TRY, timeout=(5.0, 30.0)) as client:
        with pytest.raises(EngineTimeoutError):  # the client's 30 s read timeout would wait out the 1 s latency
            client.sample([1], base_model=slow.model, timeout=(5.0, 0.2))
        assert client.sample([1], base_model=slow.model).model == slow.model


def test_habits_build_request_leaves_unset_keywords_at_their_defaults() -> None:
    """A None sampling keyword means unset: the request keeps SamplingParams' defaults for it."""
    request = build_request([1], base_model="m", max_tokens=4, seed=None)
    assert request.sampling_params == SamplingParams(max_tokens=4)
    assert build_request([1], base_model="m").sampling_params is None


def _output(sequences: int = 4, tokens: int = 16) -> SampleOutput:
    seqs = tuple(
        GeneratedSequence(
            tuple(range(tokens)),
            tuple(-0.123456789012345 * (i + 1) for i in range(tokens)),
            "length",
            "Once upon a time <there> was " * 3,
        )
        for _ in range(sequences)
    )
    body = {
        "usage": {"prompt_tokens": 3, "completion_tokens": sequences * tokens, "total_tokens": 3 + sequences * tokens}
    }
    return SampleOutput(seqs, model="step-400-37ccd49fc74a", body=body)


def test_display_repr_is_one_short_line_and_a_list_stays_small() -> None:
    """4 x 16 tokens repr in under 160 characters; the repr of 2,000 results stays under 350 KB."""
    out = _output()
    text = repr(out)
    assert "\n" not in text and len(text) < 160 and "n=4" in text and "tokens=16" in text and "0.1234567" not in text
    assert len(repr([out] * 2000)) < 350_000
    assert len(repr(out.sequences[0])) < 140


def test_display_html_is_a_table_with_the_text_escaped() -> None:
    """_repr_html_ gives one row per sequence and escapes the generated text."""
    page = _output(sequences=2)._repr_html_()
    assert page.count("<tr><td>") == 2 and "&lt;there&gt;" in page and "<there>" not in page
    assert "3 prompt + 32 completion tokens" in page


def test_display_to_dict_and_to_json_are_plain_and_strict() -> None:
    """to_dict holds every value in JSON types; to_json is strict JSON (a NaN logprob becomes null)."""
    out = _output(sequences=1, tokens=2)
    nan = SampleOutput((GeneratedSequence((1, 2), (float("nan"), -1.0), "stop"),), model="m")
    data = json.loads(out.to_json())
    assert data == out.to_dict() and data["sequences"][0]["tokens"] == [0, 1]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert math.isclose(data["sequences"][0]["logprobs"][1], -0.24691357802469)
    assert json.loads(nan.to_json())["sequences"][0]["logprobs"] == [None, -1.0]
    assert nan.usage is None and json.loads(nan.to_json())["usage"] is None
