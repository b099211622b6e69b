"""Ctrl-C means stop: sample_many, imap and submit futures, a with block left on an error, and dropped clients.

The interrupt is a real SIGINT sent to this process by a timer thread while the main thread waits, as a terminal
or a Jupyter kernel interrupt delivers it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator

import pytest

from lora_sampler import RequestCancelledError, SampleOutput, SamplerClient, SamplingInterruptedError
from lora_sampler.testing import FakeEngine

#: Seconds a hung completion takes here: whatever waits for one cannot come back before this.
HANG_SECONDS = 60.0
#: Well under a hung completion: control back, and the engine's requests gone, before this means nothing waited for
#: them. (How soon it really is, about 0.1 s, is measured by benchmarks/bench_everyday.py, not asserted here.)
STOP_SECONDS = HANG_SECONDS / 6


@contextlib.contextmanager
def sigint_after(seconds: float) -> Iterator[None]:
    """Send SIGINT to this process after ``seconds`` (Python's default handler raises KeyboardInterrupt)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def wait_until(condition: Callable[[], bool], seconds: float = STOP_SECONDS) -> bool:
    """Poll ``condition`` for up to ``seconds``; return whether it came true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def workers() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("lora_sampler"))


def open_sockets() -> int:
    """Sockets this process holds open (its file descriptors)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def hang_later(engine: FakeEngine, after: float) -> threading.Timer:
    """From ``after`` seconds on, every completion takes 60 s (those in flight too: the latency is re-read)."""
    timer = threading.Timer(after, setattr, (engine, "latency", HANG_SECONDS))
    timer.start()
    return timer


@pytest.mark.parametrize("prompts_per_request, count", [(1, 200), (None, 8000)], ids=["one-each", "batched"])
def test_interrupt_sample_many_stops_at_once_and_keeps_the_answers(
    engine: FakeEngine, prompts_per_request: Any, count: int
) -> None:
    """Ctrl-C in sample_many: control back without waiting for the hung requests (aborted); answers kept."""
    engine.latency = 0.05
    requests = [{"prompt": f"p{i}", "base_model": engine.model} for i in range(count)]
    timer = hang_later(engine, 0.4)
    with SamplerClient(engine.url, max_workers=4) as client:
        with sigint_after(0.8), pytest.raises(SamplingInterruptedError) as info:
            client.sample_many(requests, prompts_per_request=prompts_per_request)
        stopped = time.monotonic()
        timer.cancel()
        error = info.value
        assert wait_until(lambda: engine.requests_in_flight == 0) and engine.aborted_requests >= 1
        assert time.monotonic() - stopped < STOP_SECONDS
        answered = [r for r in error.results if r is not None]
        assert error.done == len(answered) >= 4 and all(isinstance(r, SampleOutput) for r in answered)
        assert [r.sequences[0].text for r in error.results[:4]] == [r.sequences[0].text for r in answered[:4]]
        assert client.last_interrupt is not None and client.last_interrupt.results == error.results
        assert client.last_interrupt.__traceback__ is None  # no frame of the call (and no cycle through the client)
        sent = len(engine.requests)
        time.sleep(0.2)
        assert len(engine.requests) == sent  # nothing new started
        engine.latency = 0.0
        assert client.sample("again", base_model=engine.model).model == engine.model  # the client still works


def test_interrupt_waiting_on_a_submit_future_cancels_the_submitted(engine: FakeEngine) -> None:
    """Ctrl-C in future.result(): the other submitted requests are cancelled or aborted, nothing waits for them."""
    engine.latency = HANG_SECONDS
    with SamplerClient(engine.url, max_workers=4) as client:
        futures = [client.submit(f"p{i}", base_model=engine.model) for i in range(12)]
        assert wait_until(lambda: engine.requests_in_flight == 4)
        started = time.monotonic()
        with sigint_after(0.2), pytest.raises(KeyboardInterrupt):
            futures[0].result()
        assert time.monotonic() - started < STOP_SECONDS
        assert wait_until(lambda: all(f.done() for f in futures) and engine.requests_in_flight == 0)
        assert sum(f.cancelled() for f in futures) == 8
        running = [f for f in futures if not f.cancelled()]
        assert all(isinstance(f.exception(), RequestCancelledError) for f in running)
        engine.latency = 0.0
        assert client.submit("again", base_model=engine.model).result().model == engine.model


def test_interrupt_imap_cancels_its_requests_in_flight(engine: FakeEngine) -> None:
    """Ctrl-C while imap waits: the generator stops and the engine aborts the requests it had in flight."""
    engine.latency = HANG_SECONDS
    with SamplerClient(engine.url, max_workers=3) as client:
        results = client.imap({"prompt": f"p{i}", "base_model": engine.model} for i in range(50))
        with sigint_after(0.3), pytest.raises(KeyboardInterrupt):
            next(results)
        assert wait_until(lambda: engine.requests_in_flight == 0) and engine.aborted_requests == 3
        assert [r.fault for r in engine.requests] == ["aborted"] * 3


def test_with_block_left_on_an_exception_does_not_wait_for_requests_in_flight(engine: FakeEngine) -> None:
    """An error inside `with SamplerClient(...)` leaves at once; the engine aborts what was in flight."""
    engine.latency = HANG_SECONDS
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        with SamplerClient(engine.url, max_workers=4) as client:
            futures = [client.submit(f"p{i}", base_model=engine.model) for i in range(6)]
            assert wait_until(lambda: engine.requests_in_flight == 4)
            raise RuntimeError("boom")
    assert time.monotonic() - started < STOP_SECONDS
    assert wait_until(lambda: engine.requests_in_flight == 0 and workers() == 0)
    assert all(f.done() for f in futures)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Cyclic garbage collection off: what is freed here is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_dropped_client_frees_threads_and_sockets_without_a_gc_and_warns(engine: FakeEngine, no_gc: None) -> None:
    """A client dropped without close() warns (ResourceWarning) and frees its threads and sockets at once."""
    sockets = open_sockets()
    client = SamplerClient(engine.url, max_workers=8)
    client.sample_many([{"prompt": "x", "base_model": engine.model}] * 16)
    assert 0 < workers() <= 8 and open_sockets() > sockets
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del client
    assert wait_until(lambda: workers() == 0)
    assert wait_until(lambda: open_sockets() <= sockets + 8)  # the engine's side closes as it reads end of file
    assert wait_until(lambda: open_sockets() == sockets)


def test_rerunning_a_client_cell_keeps_threads_and_sockets_flat(engine: FakeEngine, no_gc: None) -> None:
    """Ten re-runs of `client = SamplerClient(...); client.sample_many(...)` leave one client's threads, no more."""
    namespace: Dict[str, Any] = {}
    cell = "client = SamplerClient(url, max_workers=8)\nclient.sample_many([{'prompt': 'x', 'base_model': m}] * 16)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(10):
            exec(cell, {"SamplerClient": SamplerClient, "url": engine.url, "m": engine.model}, namespace)
        assert wait_until(lambda: 0 < workers() <= 8)  # the executor starts threads as it needs them
        sockets = open_sockets()
        namespace.clear()
    assert wait_until(lambda: workers() == 0) and sockets <= 8 + 8 + 1 + 2  # client + engine side, listener, slack
