"""FakeEngine.hold: completions kept in flight until released, or until enough are in flight together."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from _waits import wait_until

from lora_sampler.testing import FakeEngine, write_adapter

BASE = "tiny-base"


def complete(engine: FakeEngine, model: str = BASE, timeout: float = 60) -> requests.Response:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "prompt_logprobs": 0}
    return requests.post(engine.url + "/v1/completions", json=body, timeout=timeout)


def test_held_completions_wait_in_flight_until_released(engine: FakeEngine) -> None:
    engine.hold()
    with ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(complete, engine) for _ in range(3)]
        engine.wait_for_held(3)
        assert engine.held_requests == 3 and engine.requests_in_flight == 3
        assert not any(answer.done() for answer in answers) and engine.requests == []  # logged once answered
        engine.release()
        assert [answer.result().status_code for answer in answers] == [200] * 3
    assert engine.held_requests == 0
    assert complete(engine).status_code == 200  # released: no longer held


def test_a_release_that_keeps_holding_lets_the_held_go_and_holds_the_next(engine: FakeEngine) -> None:
    """``release(keep_holding=True)`` steps a job: the held completion answers, the one after it is held in turn."""
    engine.hold()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, engine)
        engine.wait_for_held()
        engine.release(keep_holding=True)
        assert first.result().status_code == 200
        second = pool.submit(complete, engine)
        engine.wait_for_held()
        assert not second.done() and len(engine.requests) == 1
        engine.release()
        assert second.result().status_code == 200
    assert engine.held_requests == 0


def test_hold_of_one_model_lets_the_others_through(engine: FakeEngine) -> None:
    engine.hold(model="other-model-name")
    assert complete(engine).status_code == 200  # another model's hold: the base model's completion goes at once
    engine.hold(model=BASE)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(complete, engine)
        engine.wait_for_held()
        engine.hold(model="another")  # the hold moves on: the held base completion goes on
        assert held.result().status_code == 200
    engine.release()


def test_until_in_flight_releases_completions_that_overlap(engine: FakeEngine) -> None:
    """Each completion waits for a second one: both are in flight together, so they overlap, whatever the speed."""
    engine.hold(until_in_flight=2)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, engine)
        engine.wait_for_held(1)
        assert not first.done()
        second = pool.submit(complete, engine)
        assert first.result().status_code == second.result().status_code == 200
    assert engine.mixed_prompt_logprobs == 0  # one model: no mix
    assert engine.held_requests == 0


def test_until_in_flight_overlaps_two_models(engine: FakeEngine, lora_dir: Path) -> None:
    write_adapter(lora_dir / "step-1", engine.model)
    engine.hold(model="step-1", until_in_flight=2)
    with ThreadPoolExecutor(1) as pool:
        adapter = pool.submit(complete, engine, "step-1")
        engine.wait_for_held()
        assert complete(engine).status_code == 200  # the base completion is not held: it frees the adapter's
        assert adapter.result().status_code == 200
    assert engine.mixed_prompt_logprobs == 2  # each asked for prompt logprobs beside the other model


def test_beside_holds_until_the_other_model_is_in_flight(engine: FakeEngine, lora_dir: Path) -> None:
    """``beside``: the adapter's completions wait for one of the base model, even when two of its own overlap."""
    write_adapter(lora_dir / "step-1", engine.model)
    engine.hold(model="step-1", beside=BASE)
    with ThreadPoolExecutor(2) as pool:
        adapter = [pool.submit(complete, engine, "step-1") for _ in range(2)]
        engine.wait_for_held(2)  # two of the held model in flight together: still held
        assert complete(engine).status_code == 200
        assert [a.result().status_code for a in adapter] == [200, 200]
    assert engine.mixed_prompt_logprobs == 3
    with pytest.raises(ValueError, match="beside must be another model than the held one"):
        engine.hold(model=BASE, beside=BASE)


def test_after_lets_that_many_completions_through_first(engine: FakeEngine) -> None:
    engine.hold(after=2)
    assert complete(engine).status_code == complete(engine).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        third = pool.submit(complete, engine)
        engine.wait_for_held()
        assert engine.calls("/v1/completions") == 2 and not third.done()
        engine.release()
        assert third.result().status_code == 200
    with pytest.raises(ValueError, match="after must be a count of completions >= 0"):
        engine.hold(after=-1)


def test_wait_for_held_times_out_naming_the_count(engine: FakeEngine) -> None:
    engine.hold()
    with pytest.raises(TimeoutError, match=r"0 completions held after 0.1 s, waiting for 1"):
        engine.wait_for_held(timeout=0.1)
    with pytest.raises(ValueError, match="until_in_flight must be None or at least 2"):
        engine.hold(until_in_flight=1)


def test_a_held_completion_whose_client_hangs_up_is_aborted(engine: FakeEngine) -> None:
    engine.hold()
    body = b'{"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        engine.wait_for_held()
    wait_until(lambda: engine.requests_in_flight == 0, "the held completion was never aborted")
    assert engine.aborted_requests == 1 and engine.held_requests == 0


def test_stop_ends_a_hold_without_a_release(lora_dir: Path) -> None:
    engine = FakeEngine(lora_dir=lora_dir).start()
    engine.hold()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(complete, engine)
        engine.wait_for_held()
        engine.stop()  # does not wait for a release: the held completion goes on, as one sleeping its latency does
        error = held.exception(timeout=60)  # answered, or its connection closed by the stop: never left hanging
        assert error is None or isinstance(error, requests.ConnectionError)
    assert engine.held_requests == 0
