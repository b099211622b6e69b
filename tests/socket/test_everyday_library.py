"""The library from a newcomer's seat: a batch error keeps the answers received, the habits of other tools get a
hint instead of a bare ``TypeError``, and a bar (with its total) wherever a fan-out runs.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, Iterator, List

import pytest

from lora_sampler import BadRequestError, SampleOutput, SamplerClient
from lora_sampler.testing import FakeEngine


@pytest.fixture
def engine_options() -> Dict[str, Any]:
    """A short context, so one long prompt is refused with vLLM's 400."""
    return {"max_model_len": 64}


def _prompts(engine: FakeEngine, count: int, too_long: int) -> List[Dict[str, Any]]:
    return [
        {"prompt": [5] * (100 if index == too_long else 3), "base_model": engine.model, "max_tokens": 2}
        for index in range(count)
    ]


def test_sample_many_error_keeps_every_answer_received(engine: FakeEngine) -> None:
    """200 prompts, one over the context: the 400 is raised, and its .results holds the answers before it in order."""
    requests = _prompts(engine, 200, too_long=150)
    with SamplerClient(engine.url, max_workers=4) as client:
        with pytest.raises(BadRequestError) as caught:
            client.sample_many(requests)
    results = caught.value.results
    assert results is not None and len(results) >= 151
    assert all(isinstance(result, SampleOutput) for result in results[:150])
    assert results[150] is None  # the failed request
    assert all(result is None or isinstance(result, SampleOutput) for result in results[151:])
    assert pickle.loads(pickle.dumps(caught.value)).results == results  # a worker process can send it back


def test_sample_many_error_from_the_input_keeps_the_answers_too(engine: FakeEngine) -> None:
    """A bad request mapping in the middle of a generator: the TypeError (raised in input order) carries every answer
    before it."""

    def requests() -> Iterator[Dict[str, Any]]:
        for number in range(39):
            yield {"prompt": [5 + number], "base_model": engine.model}
        yield {"prompt": [7], "base_model": engine.model, "n": 2}

    with SamplerClient(engine.url, max_workers=2) as client:  # 4 in flight: the first 35 were taken before the 40th
        with pytest.raises(TypeError, match="num_samples=") as caught:
            client.sample_many(requests(), prompts_per_request=1)  # one prompt a request: 4 in flight
    results = getattr(caught.value, "results", None)
    assert results is not None and len(results) == 40 and results[39] is None  # a slot per input seen: its own None
    assert all(isinstance(r, SampleOutput) for r in results[:39]) and results[0].sequences  # those before all ran


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"n": 2}, "num_samples="),
        ({"model": "step-1"}, "adapter= .*base_model="),
        ({"messages": [{"role": "user", "content": "hi"}]}, r"client\.chat\(messages"),
        ({"max_completion_tokens": 4}, "max_tokens="),
    ],
)
def test_sample_habits_get_a_hint(engine: FakeEngine, kwargs: Dict[str, Any], hint: str) -> None:
    """n=, model=, messages= and max_completion_tokens= on sample: a TypeError naming the keyword to use, no request."""
    with SamplerClient(engine.url) as client:
        with pytest.raises(TypeError, match=hint):
            client.sample([1, 2], **kwargs)
        with pytest.raises(TypeError, match=hint if "messages" not in kwargs else "unexpected"):
            client.imap([{"prompt": [1], "base_model": engine.model}], **kwargs)
    assert engine.requests == []


def test_chat_messages_given_as_a_prompt_point_to_chat(engine: FakeEngine) -> None:
    """sample([{"role": ..., "content": ...}]) names client.chat, for sample and for request mappings alike."""
    messages = [{"role": "user", "content": "hi"}]
    with SamplerClient(engine.url) as client:
        with pytest.raises(TypeError, match=r"client\.chat\(messages"):
            client.sample(messages, base_model=engine.model)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="chat messages"):
            client.sample_many([{"prompt": messages, "base_model": engine.model}])
    assert engine.requests == []


def test_imap_and_imap_unordered_show_a_bar_with_a_given_total(engine: FakeEngine, capsys: Any) -> None:
    """imap(progress=True, total=3) over a generator: a bar that reaches 3/3 and closes with the iteration."""
    requests = ({"prompt": "x", "base_model": engine.model} for _ in range(3))
    with SamplerClient(engine.url, max_workers=2) as client:
        assert len(list(client.imap(requests, progress=True, total=3))) == 3
        assert "3/3" in capsys.readouterr().err
        pairs = client.imap_unordered([{"prompt": "x", "base_model": engine.model}] * 2, progress=True)
        assert sorted(index for index, _ in pairs) == [0, 1]
        assert "2/2" in capsys.readouterr().err
        client.sample_many(({"prompt": "x", "base_model": engine.model} for _ in range(2)), progress=True, total=2)
        assert "2/2" in capsys.readouterr().err
        with pytest.raises(ValueError, match="total must be an int >= 0"):
            client.imap([], total=-1)
