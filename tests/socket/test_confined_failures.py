"""A failure is confined to what caused it: one invalid item, one failing input iterator, one prompt of a batch.

Each test counts prompts and requests with generous ceilings (never the machine's speed) against a FakeEngine on
loopback.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from lora_sampler import LoraSamplerError, SampleOutput, SamplerClient
from lora_sampler.testing import FakeEngine


def _items(engine: FakeEngine, count: int) -> List[Dict[str, Any]]:
    return [{"prompt": [5, i % 200], "base_model": engine.model, "max_tokens": 2} for i in range(count)]


# -- one invalid item, one failing input iterator (sample_many, imap, imap_unordered) ---------------------------------


@pytest.mark.parametrize("prompts_per_request", [None, 1])
def test_an_invalid_item_is_its_own_slot_error_with_return_exceptions(
    engine: FakeEngine, prompts_per_request: Any
) -> None:
    """A misspelt field and a non-request in 40 items: two TypeErrors in their slots, the other 38 answered."""
    items: List[Any] = _items(engine, 40)
    items[7] = {"prompt": [5], "base_model": engine.model, "temprature": 0.5}
    items[30] = 42
    with SamplerClient(engine.url, max_workers=2) as client:
        many = client.sample_many(items, return_exceptions=True, prompts_per_request=prompts_per_request)
        ordered = list(client.imap(items, return_exceptions=True, prompts_per_request=prompts_per_request))
        unordered = dict(client.imap_unordered(items, return_exceptions=True, prompts_per_request=prompts_per_request))
    for results in (many, ordered, [unordered[i] for i in range(40)]):
        assert isinstance(results[7], TypeError) and "temprature" in str(results[7])
        assert isinstance(results[30], TypeError) and "int" in str(results[30])
        assert [i for i, r in enumerate(results) if isinstance(r, SampleOutput)] == [
            i for i in range(40) if i not in (7, 30)
        ]
    assert sum(r.prompts for r in engine.requests if r.path == "/v1/completions") == 3 * 38  # never sent


def test_an_invalid_item_without_return_exceptions_raises_in_input_order_keeping_the_answers(
    engine: FakeEngine,
) -> None:
    items: List[Any] = _items(engine, 20)
    items[12] = {"prompt": [5], "base_model": engine.model, "temprature": 0.5}
    with SamplerClient(engine.url, max_workers=2) as client:
        with pytest.raises(TypeError, match="temprature") as info:
            client.sample_many(items, prompts_per_request=1)
    results: List[Any] = info.value.results  # type: ignore[attr-defined]
    assert all(isinstance(r, SampleOutput) for r in results[:12]) and results[12] is None


def _failing_after(engine: FakeEngine, count: int) -> Iterator[Dict[str, Any]]:
    yield from _items(engine, count)
    raise ValueError("line 51 of prompts.jsonl is not JSON")


@pytest.mark.parametrize("return_exceptions", [True, False])
@pytest.mark.parametrize("prompts_per_request", [None, 1])
def test_a_failing_input_iterator_keeps_every_answer_pulled_before_it(
    engine: FakeEngine, return_exceptions: bool, prompts_per_request: Any
) -> None:
    """A generator raising after 50 items: the 50 run to their end, .results holds 50 answers, the error says so."""
    with SamplerClient(engine.url, max_workers=4) as client:
        with pytest.raises(LoraSamplerError, match=r"raised ValueError: line 51 .* after 50 requests") as info:
            client.sample_many(
                _failing_after(engine, 50), return_exceptions=return_exceptions, prompts_per_request=prompts_per_request
            )
        results = info.value.results
        assert results is not None and len(results) == 50 and all(isinstance(r, SampleOutput) for r in results)
        assert isinstance(info.value.__cause__, ValueError)
        yielded: List[Any] = []
        with pytest.raises(LoraSamplerError, match="after 50 requests"):
            for result in client.imap(_failing_after(engine, 50), prompts_per_request=prompts_per_request):
                yielded.append(result)
        assert len(yielded) == 50 and all(isinstance(r, SampleOutput) for r in yielded)
        pairs: List[Any] = []
        with pytest.raises(LoraSamplerError, match="after 50 requests"):
            for pair in client.imap_unordered(_failing_after(engine, 50), prompts_per_request=prompts_per_request):
                pairs.append(pair)
        assert sorted(i for i, _ in pairs) == list(range(50))
