"""Outage classification and the hold/probe/re-run gate (docs/guides/outages.md), scripted (no sockets)."""

from __future__ import annotations

import threading
import time
from typing import List, Tuple

import pytest
import responses
from _waits import blocked_in, wait_until

from lora_sampler import SamplerClient
from lora_sampler._client.outage import OutageEvent, OutageGate, is_outage, probe_timeout
from lora_sampler.errors import (
    AuthenticationError,
    EngineConnectionError,
    EngineConnectTimeoutError,
    EngineStatusError,
    EngineTimeoutError,
    ModelNotFoundError,
)

ROUTER_500 = "Request failed: error sending request for url (http://127.0.0.1:35755/v1/completions)"
ROUTER_503 = "No available workers (all circuits open or unhealthy)"


@pytest.mark.parametrize(
    "error, outage",
    [
        (EngineConnectionError("refused"), True),
        (EngineConnectTimeoutError("no accept"), True),
        (EngineTimeoutError("no answer"), True),
        (EngineStatusError("x", status=500, engine_message=ROUTER_500), True),
        (EngineStatusError("x", status=503, engine_message=ROUTER_503), True),
        (EngineStatusError("x", status=500, engine_message="scripted 500"), False),
        (EngineStatusError("x", status=503, engine_message="Service Unavailable"), False),
        (EngineStatusError("x", status=400, engine_message=ROUTER_500), False),
        (ModelNotFoundError("x", status=404, engine_message="does not exist", adapter=True), False),
        (AuthenticationError("x", status=401, engine_message="Unauthorized"), False),
        (ValueError("bad argument"), False),
    ],
)
def test_is_outage_classifies_transport_errors_and_the_routers_answers(error: BaseException, outage: bool) -> None:
    """Transport errors and vllm-router's no-worker 500/503 are outages; a bad request, adapter or key is not."""
    assert is_outage(error) is outage


def test_probe_timeout_keeps_connect_and_caps_read() -> None:
    """A probe connects with the client's connect timeout and waits at most 5 s for an answer."""
    assert probe_timeout((10.0, 300.0)) == (10.0, 5.0)
    assert probe_timeout((2.0, 1.0)) == (2.0, 1.0)
    assert probe_timeout(3.0) == (3.0, 3.0)


class Engine:
    """A scripted engine: down until ``up`` is set; counts calls and probes."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.calls = 0
        self.probes = 0
        self._lock = threading.Lock()

    def call(self) -> str:
        with self._lock:
            self.calls += 1
        if not self.up.is_set():
            raise EngineConnectionError("refused")
        return "ok"

    def probe(self) -> None:
        self.probes += 1
        if not self.up.is_set():
            raise EngineConnectionError("refused")


def test_gate_holds_failed_requests_and_runs_them_again_once_the_engine_answers() -> None:
    """Requests that fail outage-class wait; after the engine answers, each runs again and succeeds once."""
    engine, events = Engine(), []
    back: List[int] = []
    gate = OutageGate(30.0, engine.probe, base_url="http://e", on_outage=events.append, on_back=lambda: back.append(1))
    results: List[str] = []
    threads = [threading.Thread(target=lambda: results.append(gate.run(engine.call))) for _ in range(4)]
    threads[0].start()
    wait_until(lambda: "held" in [e.kind for e in events], "the first request failed and is held")
    for thread in threads[1:]:
        thread.start()
    wait_until(
        lambda: engine.probes >= 1 and all(blocked_in(thread, OutageGate.run) for thread in threads[1:]),
        "the engine probed, and the three later requests wait in the gate",
    )
    assert results == [] and engine.probes >= 1
    assert engine.calls == 1  # while the engine is away, no new request is sent
    engine.up.set()
    for thread in threads:
        thread.join(10)
    assert results == ["ok"] * 4  # each request completed once
    assert engine.calls == 5  # the held one ran again; the three that waited ran once
    kinds = [e.kind for e in events]
    assert kinds[0] == "held" and kinds[-1] == "back" and back == [1]
    assert all(isinstance(e, OutageEvent) and e.max_outage == 30.0 for e in events)


def test_gate_gives_up_past_max_outage_with_the_last_error_and_sends_nothing_more() -> None:
    """Past ``max_outage`` a held request fails with its own error; later requests fail without being sent."""
    engine, events = Engine(), []
    gate = OutageGate(0.3, engine.probe, base_url="http://e", on_outage=events.append)
    started = time.monotonic()
    with pytest.raises(EngineConnectionError, match="refused"):
        gate.run(engine.call)
    assert 0.3 <= time.monotonic() - started < 10
    calls = engine.calls
    with pytest.raises(EngineConnectionError, match=r"not sent: .* unreachable for .* max_outage=0.3 s"):
        gate.run(engine.call)
    assert engine.calls == calls
    assert events[-1].kind == "gave_up" and events[-1].waited >= 0.3


def test_gate_raises_errors_that_are_not_outages_at_once() -> None:
    """A bad adapter or a refused key is not held: it is raised on the first failure, and nothing is probed."""
    probes: List[int] = []
    gate = OutageGate(30.0, lambda: probes.append(1), base_url="http://e")

    def refused() -> str:
        raise AuthenticationError("401", status=401, engine_message="Unauthorized")

    with pytest.raises(AuthenticationError):
        gate.run(refused)
    assert probes == []


def test_gate_close_releases_held_requests() -> None:
    """Closing the gate (the fan-out ended) releases held threads at once with their last error."""
    engine = Engine()
    gate = OutageGate(600.0, engine.probe, base_url="http://e")
    errors: List[BaseException] = []

    def run() -> None:
        try:
            gate.run(engine.call)
        except EngineConnectionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: engine.probes >= 1, "the request failed, is held, and probes the engine")
    gate.close()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1


def test_gate_runs_again_a_request_whose_retries_straddled_the_outage() -> None:
    """A request still retrying when the engine died, that fails with a 404 after the restart, runs again."""
    engine = Engine()
    gate = OutageGate(30.0, engine.probe, base_url="http://e")
    runs: List[str] = []
    sent = threading.Event()

    def straddling() -> str:
        runs.append("run")
        if len(runs) == 1:
            sent.set()
            engine.up.wait(10)  # its attempts ran while the engine was away, and it came back forgetting the adapter
            raise ModelNotFoundError("404", status=404, engine_message="does not exist", adapter=True)
        return "ok"

    results: List[str] = []
    first = threading.Thread(target=lambda: results.append(gate.run(straddling)))
    first.start()
    sent.wait(10)
    other = threading.Thread(target=lambda: results.append(gate.run(engine.call)))  # finds the engine down: held
    other.start()
    wait_until(lambda: engine.probes >= 1, "the other request failed, is held, and probes the engine")
    engine.up.set()
    first.join(10)
    other.join(10)
    assert results == ["ok", "ok"] and runs == ["run", "run"]

    def not_found() -> str:
        raise ModelNotFoundError("404", status=404, engine_message="does not exist", adapter=True)

    with pytest.raises(ModelNotFoundError):  # no outage during the call: the error is raised as it is
        gate.run(not_found)


@pytest.mark.parametrize(
    "health, ready",
    [
        ((503, 'Unhealthy servers: ["http://127.0.0.1:18003"]'), True),  # a router routing around a dead replica
        ((404, '{"detail": "Not Found"}'), True),  # a server without /health
        ((200, "All servers healthy"), True),
        ((503, "Service Unavailable"), False),  # an engine still starting
        ((500, "Request failed: error sending request for url (http://127.0.0.1:1/health)"), False),
    ],
)
@responses.activate
def test_probe_reads_a_router_with_one_replica_down_as_serving(health: Tuple[int, str], ready: bool) -> None:
    """A router whose ``/health`` names unhealthy workers still serves through the rest: the probe goes on.

    Read as "not back", one dead replica behind vllm-router held every outage-held request of a job until
    ``max_outage`` (600 s for the CLI) and then failed them, though the router answered every other request.
    """
    responses.add(responses.GET, "http://router/health", status=health[0], body=health[1], content_type="text/plain")
    responses.add(responses.GET, "http://router/v1/models", json={"object": "list", "data": [{"id": "base"}]})
    with SamplerClient("http://router") as client:
        if ready:
            client.wait_ready(0)
        else:
            with pytest.raises(EngineConnectionError, match="did not answer"):
                client.wait_ready(0)
    assert [call.request.url.rsplit("/", 1)[-1] for call in responses.calls] == (
        ["health", "models"] if ready else ["health"]
    )
