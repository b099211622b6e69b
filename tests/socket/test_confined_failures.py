"""A failure is confined to what caused it: one invalid item, one failing input iterator, one prompt of a batch.

Each test counts prompts and requests with generous ceilings (never the machine's speed) against a FakeEngine on
loopback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
from test_hostile_jobs import rows, sample_argv, write_prompts

from lora_sampler import (
    LoraSamplerError,
    SampleOutput,
    SamplerClient,
    SamplingInterruptedError,
    ScoreOutput,
    ScoreRequest,
)
from lora_sampler.cli import main
from lora_sampler.errors import BadRequestError, EngineError
from lora_sampler.testing import FakeEngine

#: The generous deadline of every wait on another thread or the engine, in seconds.
WAIT = 60.0


def wait_until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` until it holds or ``WAIT`` passes; whether it held."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _held_run(
    engine: FakeEngine,
    client: SamplerClient,
    items: List[Dict[str, Any]],
    while_held: Callable[[], None] = lambda: None,
    **kwargs: Any,
) -> List[Any]:
    """``sample_many`` with the engine holding the first request until every item was pulled (then ``while_held``
    runs), so the items after the first go in full batches (the one worker is busy), whatever the machine's speed.

    The first request is held past the engine's fault check (``FakeEngine.hold``), so a fault ``while_held`` scripts
    is the next request's, never the held one's (waiting for it to be in flight left a gap before that check)."""
    pulled = threading.Semaphore(0)

    def counted() -> Iterator[Dict[str, Any]]:
        for item in items:
            yield item
            pulled.release()

    engine.hold()
    with ThreadPoolExecutor(1) as runner:
        job = runner.submit(client.sample_many, counted(), return_exceptions=True, **kwargs)
        try:
            for _ in items:
                assert pulled.acquire(timeout=WAIT)
            engine.wait_for_held(1, timeout=WAIT)
            while_held()
        finally:
            engine.release()
        return job.result(timeout=WAIT)


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


# -- one prompt's failure in a batch is that prompt's alone ---------------------------------------------------------


def _completions(engine: FakeEngine) -> List[Any]:
    return [record for record in engine.requests if record.path == "/v1/completions"]


@pytest.mark.parametrize("kind", ["500", "nan", "echo"])
def test_one_prompts_failure_fails_that_prompt_only(engine: FakeEngine, kind: str) -> None:
    """One prompt of 64 makes its request fail (a 500, a NaN in its part, a wrong echo): 63 answered, at most it errs.

    On 00c7ac5 the whole request failed, 31 innocent prompts of 32 (a NaN or a wrong echo spoils the whole body).
    """
    engine.inject_prompt_fault(kind, marker=999)
    items = _items(engine, 64)
    items[45]["prompt"] = [5, 999]
    with SamplerClient(engine.url, max_workers=1) as client:
        results = client.sample_many(items, return_exceptions=True, prompts_per_request=32)
    failed = [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)]
    if kind == "echo":  # alone, its answer needs no echo to be matched: answered
        assert failed == []
    else:
        assert failed == [45], f"{len(failed)} prompts failed"
        assert isinstance(results[45], EngineError) and (kind != "500" or "scripted failure" in str(results[45]))
    assert [r.body["choices"][0]["prompt_token_ids"] for i, r in enumerate(results) if i != 45] == [
        item["prompt"] for i, item in enumerate(items) if i != 45
    ]
    assert len(_completions(engine)) <= 2 + 2 * (1 + 2 * 5)  # two batches, then about two requests per halving


def test_one_prompts_500_while_scoring_fails_that_score_only(engine: FakeEngine) -> None:
    engine.inject_prompt_fault("500", marker=999)
    requests = [ScoreRequest([5, 6 + i % 50, 7], base_model=engine.model) for i in range(40)]
    requests[3] = ScoreRequest([5, 999, 7], base_model=engine.model)
    with SamplerClient(engine.url, max_workers=2) as client:
        results = client.sample_many(requests, return_exceptions=True)
    assert [i for i, r in enumerate(results) if not isinstance(r, ScoreOutput)] == [3]


def test_a_one_off_500_for_a_batch_is_resent_and_every_prompt_answered(engine: FakeEngine) -> None:
    """A 500 for a full batch that does not come again (the engine's, no prompt's): every prompt is answered.

    On 00c7ac5 each of the batch's 8 prompts got the 500. The batch is made full for sure: the one worker is held on
    the first request (the engine's latency) until the input has given all of the next batch's prompts.
    """
    with SamplerClient(engine.url, max_workers=1) as client:
        results = _held_run(
            engine,
            client,
            _items(engine, 9),
            lambda: engine.inject_fault("status", status=500, count=1, message="scripted engine failure"),
            prompts_per_request=8,
        )
    assert all(isinstance(r, SampleOutput) for r in results)
    sent = _completions(engine)
    assert [(r.status, r.prompts) for r in sent[:2]] == [(200, 1), (500, 0)] and len(sent) <= 2 + 2 + 2 * 3 + 3


def test_a_request_wide_refusal_costs_at_most_three_requests_a_batch(make_engine: Any) -> None:
    """max_tokens over the context refuses every prompt: 2,000 prompts in batches of 32 cost about one request a
    batch after the first finds it request-wide (3,924 requests on 00c7ac5; one prompt a request: 2,000)."""
    engine = make_engine(max_model_len=64)
    items = [{"prompt": [5, i % 200, 7], "base_model": engine.model, "max_tokens": 100} for i in range(2000)]
    with SamplerClient(engine.url, max_workers=4) as client:
        results = client.sample_many(items, return_exceptions=True, prompts_per_request=32)
        assert all(isinstance(r, BadRequestError) and "max_tokens" in str(r) for r in results)
        sent = len(_completions(engine))
        assert sent <= 2000 // 32 * 2 + 3 * 4, sent  # every batch once (ramp-up batches are smaller), a probe each
        engine.reset_log()
        again = client.sample_many(items[:320], return_exceptions=True, prompts_per_request=32)
    assert all(isinstance(r, BadRequestError) for r in again)
    assert sum(r.prompts for r in _completions(engine)) == 320  # remembered: no batch split again


def test_a_request_wide_refusal_of_one_setting_does_not_stop_the_split_of_another(make_engine: Any) -> None:
    """A request-wide 400 remembered for max_tokens=100 leaves max_tokens=2's one bad prompt confined as before."""
    engine = make_engine(max_model_len=64)
    with SamplerClient(engine.url, max_workers=1) as client:
        wide = [{"prompt": [5, i, 7], "base_model": engine.model, "max_tokens": 100} for i in range(64)]
        assert all(isinstance(r, BadRequestError) for r in client.sample_many(wide, return_exceptions=True))
        items = _items(engine, 32)
        items[9]["prompt"] = [5] * 80  # longer than the context
        results = client.sample_many(items, return_exceptions=True, prompts_per_request=32)
    assert [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)] == [9]


@pytest.mark.parametrize("text", [False, True], ids=["token-ids", "text"])
def test_swapped_choices_without_the_echo_are_never_another_prompts_answer(engine: FakeEngine, text: bool) -> None:
    """Two prompts' choices swapped in an answer that echoes no prompt token ids: every output is its own prompt's.

    On 00c7ac5, 2 of 8 outputs were the other prompt's (only an echo of other ids was refused).
    """
    engine.inject_prompt_fault("swap", marker="MARK" if text else 999)
    prompts: List[Any] = [f"question {i}:" for i in range(8)] if text else [[5, 6 + i] for i in range(8)]
    prompts[2] = "question MARK:" if text else [5, 999]
    items = [{"prompt": p, "base_model": engine.model, "max_tokens": 3, "temperature": 0.0} for p in prompts]
    with SamplerClient(engine.url, max_workers=1) as client:
        alone = client.sample_many(items, prompts_per_request=1)  # a prompt alone is answered right
        engine.reset_log()
        batched = _held_run(engine, client, items, prompts_per_request=8)
    assert [o.sequences for o in batched] == [o.sequences for o in alone]
    assert sum(r.prompts for r in _completions(engine)) > 8  # the mixed-up answer came, and was sent again


# -- a text that is no text is refused before sending, as a line's id is ------------------------------------------


def test_a_text_prompt_holding_a_lone_surrogate_is_refused_before_sending(engine: FakeEngine) -> None:
    """A prompt, a completion to score or a chat message holding ``\\ud800``: refused, nothing sent for it.

    On 00c7ac5 a text prompt holding one was sent (a line's ``id`` holding one was refused)."""
    items: List[Any] = [{"prompt": f"q{i}", "base_model": engine.model, "max_tokens": 2} for i in range(6)]
    items[1] = {"prompt": "bad \ud800 text", "base_model": engine.model}
    items[3] = {"prompt": ["a", "b"], "base_model": engine.model}  # no prompt either: a list of texts
    items[4] = {"messages": [{"role": "user", "content": "hi \ud800"}], "base_model": engine.model}
    with SamplerClient(engine.url, max_workers=2) as client:
        results = client.sample_many(items, return_exceptions=True)
    for position in (1, 4):
        assert isinstance(results[position], ValueError) and "lone surrogate" in str(results[position])
    with pytest.raises(ValueError, match=r"completion holds a lone surrogate \(\\udc80\) at character 1"):
        ScoreRequest("q:", completion=" \udc80", base_model=engine.model)
    assert [isinstance(r, SampleOutput) for r in results] == [True, False, True, False, False, True]
    assert sum(r.prompts for r in _completions(engine)) == 3 and engine.calls("/v1/chat/completions") == 0


def test_cli_a_line_whose_prompt_holds_a_lone_surrogate_is_one_error_row(engine: FakeEngine, tmp_path: Path) -> None:
    inp, out = write_prompts(tmp_path / "in.jsonl", 20, {7: '{"id": "s", "prompt": "bad \\ud800"}'}), tmp_path / "o"
    assert main(sample_argv(engine, inp, out)) == 1
    errors = [row for row in rows(out) if "error" in row]
    assert len(rows(out)) == 20 and len(errors) == 1 and "lone surrogate" in errors[0]["error"]["message"]
    assert sum(r.prompts for r in _completions(engine)) == 19


def test_a_routers_outage_500_for_a_batch_is_held_and_sent_again_whole(engine: FakeEngine) -> None:
    """A router's "no worker reachable" 500 is an outage, not a prompt's failure: held (max_outage) and the batch
    sent again as one request, never split; a poisoned prompt's 500 in the same job is still its own."""
    engine.inject_prompt_fault("500", marker=999)
    items = _items(engine, 9)
    items[4]["prompt"] = [5, 999]
    outage = "Request failed: error sending request for url (http://replica-1/v1/completions)"
    with SamplerClient(engine.url, max_workers=1) as client:
        results = _held_run(
            engine,
            client,
            items,
            lambda: engine.inject_fault("status", status=500, count=1, message=outage),
            prompts_per_request=8,
            max_outage=60,
        )
    assert [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)] == [4]
    sent = [(r.status, r.prompts) for r in _completions(engine)]
    assert sent[:3] == [(200, 1), (500, 0), (500, 8)], sent  # held, then the batch whole again (the poisoned 500)


def test_ctrl_c_while_a_batchs_failure_is_being_confined_stops_at_once(engine: FakeEngine) -> None:
    """Ctrl-C while the prompts of a failed batch are sent again: the job stops, the held request's connection is
    shut (the engine sees the client hang up; the worker is free at once), and .results keeps the answer received
    before. The engine holds the first request until the failing batch is full, then the split's first request
    until the interrupt has come: each step waits on the engine's hold, never on the machine's speed."""
    items = _items(engine, 9)
    pulled = threading.Semaphore(0)

    def counted() -> Iterator[Dict[str, Any]]:
        for item in items:
            yield item
            pulled.release()

    def interrupt_while_splitting() -> None:
        if all(pulled.acquire(timeout=WAIT) for _ in items):
            engine.wait_for_held(1, timeout=WAIT)  # past its fault check: the fault below is the next request's
            engine.inject_fault("status", status=500, count=1)  # the full batch's 500
            engine.release(keep_holding=True)  # the first request answers; the split's first is held
            if wait_until(lambda: len(_completions(engine)) == 2):  # the first's answer and the batch's 500
                engine.wait_for_held(1, timeout=WAIT)
                os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    killer = threading.Thread(target=interrupt_while_splitting)
    engine.hold()
    try:
        with SamplerClient(engine.url, max_workers=1) as client:
            killer.start()
            with pytest.raises(SamplingInterruptedError) as info:
                client.sample_many(counted(), prompts_per_request=8, return_exceptions=True)
            # The held request's connection was shut: the engine aborts it (a hold ends when its client hangs up).
            assert wait_until(lambda: engine.aborted_requests == 1 and engine.requests_in_flight == 0)
            engine.release()
            assert client.submit([5, 6], base_model=engine.model, max_tokens=2).result(timeout=WAIT).sequences
    finally:
        killer.join(WAIT)
        signal.signal(signal.SIGINT, previous)
        engine.release()
    results = info.value.results
    assert isinstance(results[0], SampleOutput) and all(r is None for r in results[1:])
