"""The whole-answer deadline under load: many dripping answers at once, no stray cut of a reused connection, and
the deadline in a forked child. Real loopback servers; every server thread is stopped before the test ends.
"""

from __future__ import annotations

import copy
import socketserver
import threading
import time
from typing import Any, Iterator, List

import pytest
from test_client_lifecycle import in_forked_child

from lora_sampler import EngineTimeoutError, RetryPolicy, SamplerClient
from lora_sampler.testing import FakeEngine

ONCE = RetryPolicy(max_attempts=1)
#: The head a dripping server sends one byte every DRIP_SECONDS (about 20 s in all).
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 400 + b"\r\n"
DRIP_SECONDS = 0.05


class DrippingServer:
    """Answers every connection, on its own thread, by dripping ``HEAD`` one byte at a time until stopped."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.finished = threading.Event()  # set if any connection got its whole head: the client waited for it
        stop, finished = self.stop, self.finished

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)
                for byte in HEAD:
                    if stop.wait(DRIP_SECONDS):
                        return
                    try:
                        self.request.sendall(bytes([byte]))
                    except OSError:  # the client shut the connection down: what the deadline does
                        return
                finished.set()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> DrippingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def dripping() -> Iterator[DrippingServer]:
    with DrippingServer() as server:
        yield server


def test_deadline_many_dripping_answers_at_once_each_end_at_the_read_timeout(dripping: DrippingServer) -> None:
    """Eight requests in flight, each on a server dripping its headers: all end as timeouts near the 1 s timeout."""
    with SamplerClient(dripping.url, timeout=(1.0, 1.0), retry=ONCE, max_workers=8) as client:
        started = time.monotonic()
        outcomes = client.sample_many([{"prompt": [i], "base_model": "m"} for i in range(8)], return_exceptions=True)
        elapsed = time.monotonic() - started
    assert all(isinstance(outcome, EngineTimeoutError) for outcome in outcomes), outcomes
    assert not dripping.finished.is_set()
    assert elapsed < 10, f"{elapsed:.1f} s for 8 answers that each take about 20 s to drip"


def test_deadline_never_cuts_a_connection_after_its_answer_came(engine: FakeEngine) -> None:
    """Answers within a short read timeout, on reused connections, with pauses past old deadlines: none is cut."""
    engine.latency = 0.05
    # A read timeout of 1.5 s: at 0.4 s, a loaded machine (load 19) answered a 50 ms request too late, a real timeout.
    with SamplerClient(engine.url, timeout=(2.0, 1.5), retry=ONCE, max_workers=4) as client:
        for _ in range(3):
            outcomes = client.sample_many(
                [{"prompt": f"p{i}", "base_model": engine.model} for i in range(12)], return_exceptions=True
            )
            assert [type(outcome).__name__ for outcome in outcomes] == ["SampleOutput"] * 12
            for _ in range(4):
                assert client.sample("one", base_model=engine.model).sequences
            time.sleep(1.6)  # past every deadline armed so far: a stray cut would hit the pooled connections now
    assert engine.connections_opened <= 4 + 1  # the connections were reused, not cut and reopened


def test_deadline_holds_in_a_forked_child(dripping: DrippingServer, engine: FakeEngine) -> None:
    """A child forked after the parent's watchdog ran still ends a dripped answer at the read timeout."""
    with SamplerClient(dripping.url, timeout=(1.0, 1.0), retry=ONCE) as client:
        with pytest.raises(EngineTimeoutError):
            client.sample([1], base_model="m")  # the parent's watchdog thread is running now

        def dripped_in_child() -> List[Any]:
            started = time.monotonic()
            try:
                client.sample([2], base_model="m")
            except EngineTimeoutError as exc:
                return ["timeout", time.monotonic() - started, "read timeout" in str(exc)]
            return ["answered", time.monotonic() - started, False]

        status, (what, elapsed, named) = in_forked_child(dripped_in_child)
    assert status == "ok" and what == "timeout" and named
    assert elapsed < 10


def test_deadline_copy_of_a_client_is_the_client(engine: FakeEngine) -> None:
    """copy and deepcopy share the client (its key too); only pickling makes a new client, without the key."""
    with SamplerClient(engine.url, api_key="sk-kept") as client:
        holder = {"client": client}
        assert copy.copy(client) is client and copy.deepcopy(holder)["client"] is client
        assert copy.deepcopy(holder)["client"].has_api_key
