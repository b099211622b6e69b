"""Ctrl-C means stop: sample_many, imap and submit futures, a with block left on an error, and dropped clients.

The interrupt is a real SIGINT sent to the main thread by another thread once the job is where it should find it
(requests held by the engine, the main thread waiting), as a terminal or a Jupyter kernel interrupt delivers it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List

import pytest
from _waits import blocked_in
from _waits import wait_until as wait_for

from lora_sampler import RequestCancelledError, SampleOutput, SamplerClient, SamplingInterruptedError
from lora_sampler.testing import FakeEngine, encode_text

#: Seconds a hung completion takes here: whatever waits for one cannot come back before this.
HANG_SECONDS = 60.0
#: Well under a hung completion: control back, and the engine's requests gone, before this means nothing waited for
#: them. (How soon it really is, about 0.1 s, is measured by benchmarks/bench_everyday.py, not asserted here.)
STOP_SECONDS = HANG_SECONDS / 6


def interrupt_main_thread() -> None:
    """SIGINT to the main thread itself: sent to the process, the kernel may hand it to another thread, and the main
    thread, blocked on a lock, would not see it until something else woke it."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def main_thread_waits_in(function: Callable[..., Any]) -> Callable[[], None]:
    """A ``sigint_when`` step: ready once the main thread is blocked in a ``threading.Condition.wait`` called from
    ``function``, so the interrupt finds the call under test waiting, whatever the machine's speed (a timer could
    fire before the call started)."""
    main = threading.main_thread()
    return lambda: wait_for(lambda: blocked_in(main, function), f"the main thread waits in {function.__qualname__}")


@contextlib.contextmanager
def sigint_when(ready: Callable[[], None]) -> Iterator[None]:
    """Send SIGINT to the main thread once ``ready()`` returns, from a thread, while the main thread runs the block.

    ``ready`` blocks until the job is where the interrupt should find it (e.g. ``engine.wait_for_held``), with its
    own deadline: when it raises, SIGINT is still sent (the block ends) and the error fails the test after it.
    Python drops a KeyboardInterrupt raised while it runs a weakref callback (a garbage collection in the main thread:
    "Exception ignored", not reported here); a block still running ``STOP_SECONDS`` after one is pressed again, as a
    user would.
    """
    failures: List[BaseException] = []
    pressed, finished = threading.Event(), threading.Event()
    unraisable_hook = sys.unraisablehook

    def report(unraisable: Any) -> None:
        if unraisable.exc_type is not KeyboardInterrupt:
            unraisable_hook(unraisable)

    def handler(signum: int, frame: Any) -> None:
        pressed.set()
        raise KeyboardInterrupt

    def interrupt() -> None:
        try:
            ready()
        except BaseException as error:  # reported by the main thread after the block
            failures.append(error)
        for _ in range(3):
            pressed.clear()
            interrupt_main_thread()
            if pressed.wait(STOP_SECONDS) and finished.wait(STOP_SECONDS):
                return

    previous = signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = report
    thread = threading.Thread(target=interrupt, name="test-sigint", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()
        sys.unraisablehook = unraisable_hook
        signal.signal(signal.SIGINT, previous)
    if failures:
        raise failures[0]


def mid_run(engine: FakeEngine, *, answered: int, held: int) -> Callable[[], None]:
    """A ``sigint_when`` step: ``engine`` answers its first ``answered`` completions and holds the rest; ready once
    ``held`` are held at once (every worker is then waiting on the engine, and every answer before them reached the
    client). The hold is set here, before the job starts: set once the answers were seen, a busy machine let a
    200-prompt job all but finish first (1 held of 4 after 60 s)."""
    engine.hold(after=answered)

    def ready() -> None:
        engine.wait_for_held(held, timeout=HANG_SECONDS)
        deadline = time.monotonic() + HANG_SECONDS
        while sum(r.prompts for r in engine.requests if r.status == 200) < answered:
            assert time.monotonic() < deadline, f"the engine never answered {answered} prompts"
            time.sleep(0.005)

    return ready


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


@pytest.mark.parametrize("prompts_per_request, count", [(1, 200), (None, 8000)], ids=["one-each", "batched"])
def test_interrupt_sample_many_stops_at_once_and_keeps_the_answers(
    engine: FakeEngine, prompts_per_request: Any, count: int
) -> None:
    """Ctrl-C in sample_many: control back without waiting for the held requests (aborted); answers kept."""
    requests = [{"prompt": f"p{i}", "base_model": engine.model} for i in range(count)]
    with SamplerClient(engine.url, max_workers=4) as client:
        with sigint_when(mid_run(engine, answered=4, held=4)), pytest.raises(SamplingInterruptedError) as info:
            client.sample_many(requests, prompts_per_request=prompts_per_request)
        stopped = time.monotonic()
        error = info.value
        assert wait_until(lambda: engine.requests_in_flight == 0) and engine.aborted_requests >= 1
        assert time.monotonic() - stopped < STOP_SECONDS
        answered = [r for r in error.results if r is not None]
        assert error.done == len(answered) >= 4 and all(isinstance(r, SampleOutput) for r in answered)
        for index, result in enumerate(error.results):  # each answer in its prompt's place
            assert result is None or result.body["choices"][0]["prompt_token_ids"] == encode_text(f"p{index}")
        assert client.last_interrupt is not None and client.last_interrupt.results == error.results
        assert client.last_interrupt.__traceback__ is None  # no frame of the call (and no cycle through the client)
        sent = len(engine.requests)
        time.sleep(0.2)
        assert len(engine.requests) == sent  # nothing new started
        engine.release()
        assert client.sample("again", base_model=engine.model).model == engine.model  # the client still works


def test_interrupt_waiting_on_a_submit_future_cancels_the_submitted(engine: FakeEngine) -> None:
    """Ctrl-C in future.result(): the other submitted requests are cancelled or aborted, nothing waits for them."""
    engine.latency = HANG_SECONDS
    with SamplerClient(engine.url, max_workers=4) as client:
        futures = [client.submit(f"p{i}", base_model=engine.model) for i in range(12)]
        assert wait_until(lambda: engine.requests_in_flight == 4)
        started = time.monotonic()
        with sigint_when(main_thread_waits_in(type(futures[0]).result)), pytest.raises(KeyboardInterrupt):
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
    engine.hold()
    with SamplerClient(engine.url, max_workers=3) as client:
        results = client.imap({"prompt": f"p{i}", "base_model": engine.model} for i in range(50))
        with sigint_when(lambda: engine.wait_for_held(3, timeout=HANG_SECONDS)), pytest.raises(KeyboardInterrupt):
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
