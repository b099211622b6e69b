"""lora_sampler through a real vllm-router (consistent hash on X-Session-ID) over three FakeEngine processes.

Run with ``tox -e router``. Each replica is its own process with its own adapter table, as vLLM replicas are; they
share one resolver directory, as replicas on one shared filesystem do (docs/scale-out.md).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Set

import pytest
from _fleet import BASE_MODEL, ROUTER_DEAD_WORKER, Replica, Router
from _waits import wait_until

from lora_sampler import EngineStatusError, SampleOutput, SamplerClient, SampleRequest
from lora_sampler.testing import write_adapter

pytestmark = [pytest.mark.router, pytest.mark.usefixtures("no_waits")]

COMPLETIONS = "/v1/completions"
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
#: ``max_outage`` of the jobs that hold the router's outage answers (generous: a loaded machine).
OUTAGE_BOUND = 60.0


def _logs(replicas: List[Replica]) -> List[List[Dict[str, Any]]]:
    return [replica.requests() for replica in replicas]


def _replica_of_sessions(logs: List[List[Dict[str, Any]]]) -> Dict[str, Set[int]]:
    """Map each session id to the replicas that saw any request carrying it."""
    seen: Dict[str, Set[int]] = collections.defaultdict(set)
    for index, log in enumerate(logs):
        for record in log:
            if record["session_id"]:
                seen[record["session_id"]].add(index)
    return seen


def test_router_fresh_adapter_self_heals_and_loads_reach_the_404_replica(
    router: Router, replicas: List[Replica], lora_dir: str
) -> None:
    """A fresh adapter whose visibility lags differently on each replica is served; each load goes where the 404 was.

    vllm-router does not forward ``X-Session-ID`` on the load route (it only routes by it), so the calls run one
    at a time and each call's logs are read on their own: every load of a call must land on the replica that
    answered that call's 404s.
    """
    write_adapter(os.path.join(lora_dir, "fresh"), BASE_MODEL)
    lags = (1, 3, 5)
    for lag, replica in zip(lags, replicas):
        replica.command("delay", name="fresh", requests=lag)
    not_found = [0, 0, 0]
    loads_seen = 0
    with SamplerClient(router.url, lora_base_dir=lora_dir) as client:
        for i in range(30):
            for replica in replicas:
                replica.command("reset")
            out = client.sample(f"row {i}", adapter="fresh")  # a fresh X-Session-ID per call
            assert out.sequences
            logs = _logs(replicas)
            sessions = _replica_of_sessions(logs)
            assert len(sessions) == 1, "a call's session id was split across replicas"
            (served_by,) = next(iter(sessions.values()))
            loads = [index for index, log in enumerate(logs) for r in log if r["path"] == LOAD]
            misses = sum(r["path"] == COMPLETIONS and r["status"] == 404 for r in logs[served_by])
            assert len(loads) == misses, f"call {i}: {misses} 404s but {len(loads)} loads"
            assert set(loads) <= {served_by}, f"call {i}: answered 404 on replica {served_by}, loads went to {loads}"
            not_found[served_by] += misses
            loads_seen += len(loads)
    assert loads_seen >= max(lags)
    for lag, misses, replica in zip(lags, not_found, replicas):
        assert misses == lag or "fresh" not in replica.command("loaded")  # a replica no session mapped to


def test_router_sample_many_64_over_a_new_adapter_keeps_one_load_in_flight_per_replica(
    router: Router, replicas: List[Replica], lora_dir: str
) -> None:
    """64 concurrent requests over one new adapter all succeed, with at most one load in flight per replica."""
    write_adapter(os.path.join(lora_dir, "wide"), BASE_MODEL)
    for replica in replicas:
        replica.command("delay", name="wide", requests=4)
    with SamplerClient(router.url, lora_base_dir=lora_dir, max_workers=16) as client:
        results = client.sample_many([{"prompt": [5, 6, i], "adapter": "wide"} for i in range(64)])
    assert len(results) == 64 and all(isinstance(r, SampleOutput) for r in results)
    peaks = [replica.command("max_loads", name="wide") for replica in replicas]
    assert max(peaks) <= 1, peaks
    assert sum(r["path"] == LOAD for log in _logs(replicas) for r in log) >= 1


def test_router_unload_with_the_session_reaches_the_replica_that_holds_the_adapter(
    router: Router, replicas: List[Replica], lora_dir: str
) -> None:
    """An unload sent with the sampling session's id lands on the replica that loaded the adapter, and only there."""
    write_adapter(os.path.join(lora_dir, "held"), BASE_MODEL)
    with SamplerClient(router.url, lora_base_dir=lora_dir) as client:
        client.sample("hello", adapter="held", session_id="holder")
        holders = [i for i, replica in enumerate(replicas) if "held" in replica.command("loaded")]
        assert len(holders) == 1
        client.unload("held", session_id="holder")
    logs = _logs(replicas)
    unloads = [(i, r) for i, log in enumerate(logs) for r in log if r["path"] == UNLOAD]
    assert [(i, r["status"]) for i, r in unloads] == [(holders[0], 200)]
    assert all("held" not in replica.command("loaded") for replica in replicas)


def test_router_unload_from_every_replica_with_one_client_per_replica_url(
    router: Router, replicas: List[Replica], lora_dir: str
) -> None:
    """Through the router an unload reaches one replica; a client per replica URL unloads from all of them."""
    write_adapter(os.path.join(lora_dir, "everywhere"), BASE_MODEL)
    with SamplerClient(router.url, lora_base_dir=lora_dir) as client:
        # 30 requests of one prompt each (the client may otherwise fold them into a few): the router spreads them
        client.sample_many([{"prompt": "x", "adapter": "everywhere"} for _ in range(30)], prompts_per_request=1)
        assert all("everywhere" in replica.command("loaded") for replica in replicas)
        client.unload("everywhere", session_id="whoever")
    assert sum("everywhere" in replica.command("loaded") for replica in replicas) == 2  # one replica only
    for replica in replicas:
        with SamplerClient(replica.url) as direct:
            direct.unload("everywhere")  # 200, or 404 "cannot be found" where it was already gone: both fine
    assert all("everywhere" not in replica.command("loaded") for replica in replicas)


def _rows(
    n: int, replicas: List[Replica], kill_at: Optional[int] = None, served: Optional[List[int]] = None
) -> Iterator[SampleRequest]:
    """Yield ``n`` adapter requests; at row ``kill_at`` kill ``replicas`` (imap pulls rows lazily, mid-batch).

    ``served`` receives, per killed replica, the completions it had answered just before its death.
    """
    for i in range(n):
        if i == kill_at:
            for replica in replicas:
                if served is not None:
                    served.append(sum(r["path"] == COMPLETIONS for r in replica.requests()))
                replica.kill()
        yield SampleRequest([7, 8, i % 200], adapter="steady")


def test_router_one_replica_killed_mid_batch_costs_no_rows(
    router: Router, replicas: List[Replica], lora_dir: str
) -> None:
    """A replica killed with requests in flight costs no row when the job holds outages (``max_outage``).

    Until its health check notices (about a second), the router answers requests hashed to the dead replica with
    its own 500 "error sending request"; the client holds them as an outage and re-sends them once the router
    answers its probe. That probe's ``/health`` then says 503 "Unhealthy servers": the router serves through the
    other replicas, so the hold ends there (read as "not back", it held them until ``max_outage`` and failed them).
    """
    write_adapter(os.path.join(lora_dir, "steady"), BASE_MODEL)
    with SamplerClient(router.url, lora_base_dir=lora_dir, max_workers=8) as client:
        served: List[int] = []
        # One prompt per request: the test counts requests per replica as they are answered, killed and re-sent.
        results = client.sample_many(
            _rows(240, replicas[:1], kill_at=40, served=served),
            return_exceptions=True,
            prompts_per_request=1,
            max_outage=OUTAGE_BOUND,
        )
    assert replicas[0].process.exitcode is not None and served[0] > 0, served
    assert all(isinstance(r, SampleOutput) for r in results), [r for r in results if not isinstance(r, SampleOutput)]
    assert sum(r["status"] == 200 for log in _logs(replicas[1:]) for r in log) >= 240 - 40
    assert "Unhealthy servers" in router.wait_unhealthy()
    with SamplerClient(router.url) as client:
        client.wait_ready(0)  # one probe: a router serving around a dead replica is ready


def test_router_fleet_down_mid_batch_fails_rows_with_the_routers_answer_then_resumes(
    replicas: List[Replica], lora_dir: str
) -> None:
    """With every replica dead, rows carry the router's 500 naming its error; rerun on restarted replicas, all pass.

    The router keeps vllm-router's default health checks (60 s) with the circuit breaker off, so its answer is
    always the 500 for an unreachable worker (with the breaker on, later rows get 503 "No available workers").
    """
    write_adapter(os.path.join(lora_dir, "steady"), BASE_MODEL)
    router = Router([r.url for r in replicas], fast_health=False, extra=["--disable-circuit-breaker"])
    restarted: List[Replica] = []
    try:
        with SamplerClient(router.url, lora_base_dir=lora_dir, max_workers=8) as client:
            # One prompt per request: rows pulled before the kill must be answered before it, not held for a batch.
            results = client.sample_many(
                _rows(120, replicas, kill_at=40), return_exceptions=True, prompts_per_request=1
            )
            assert len(results) == 120
            assert all(isinstance(r, SampleOutput) for r in results[:20])  # answered before the kill
            failed = [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)]
            assert set(range(40, 120)) <= set(failed)
            for i in failed:
                error = results[i]
                assert isinstance(error, EngineStatusError), repr(error)
                assert error.status == 500 and error.attempts == 1  # a 5xx is raised at once
                assert error.engine_message.startswith(ROUTER_DEAD_WORKER), error.engine_message
                assert ROUTER_DEAD_WORKER in str(error) and "/v1/completions" in str(error)

            restarted = [replica.restart() for replica in replicas]  # same ports: the router's URLs
            again = client.sample_many([_request_of(results, i) for i in failed], return_exceptions=True)
        assert all(isinstance(r, SampleOutput) for r in again), [r for r in again if not isinstance(r, SampleOutput)][
            :3
        ]
    finally:
        router.stop()
        for replica in restarted:
            replica.stop()


def test_router_fleet_down_then_restarted_with_max_outage_completes_every_row(
    replicas: List[Replica], lora_dir: str
) -> None:
    """Every replica killed mid-batch, restarted 3 s later: with ``max_outage`` the router's 500/503 answers are
    held as an outage, and every row is answered once the fleet is back (the restarted replicas forgot the adapter).

    The router's circuit breakers keep every worker out for ``--cb-timeout-duration-secs`` after they are back
    (60 s by default, measured); 5 s here keeps the test short. The restart also waits until the client held its
    requests (its first on_outage event), however slow the machine is to notice.
    """
    write_adapter(os.path.join(lora_dir, "steady"), BASE_MODEL)
    router = Router([r.url for r in replicas], extra=["--cb-timeout-duration-secs", "5"])
    restarted: List[Replica] = []
    events: List[Any] = []

    def restart_once_held(killed: float) -> None:
        try:
            wait_until(lambda: [e.kind for e in events][:1] == ["held"], "the client held its requests")
            time.sleep(max(0.0, killed + 3.0 - time.monotonic()))  # the fleet's downtime, not a wait
        finally:  # restarted even so: the batch ends, and the assertions say what went wrong
            restarted.extend(replica.restart() for replica in replicas)

    restarters: List[threading.Thread] = []

    def rows() -> Iterator[SampleRequest]:
        for i, row in enumerate(_rows(160, replicas, kill_at=40)):
            if i == 40:  # the replicas were killed just before this row was pulled
                restarters.append(threading.Thread(target=restart_once_held, args=(time.monotonic(),)))
                restarters[0].start()
            yield row

    try:
        with SamplerClient(router.url, lora_base_dir=lora_dir, max_workers=8) as client:
            results = client.sample_many(rows(), return_exceptions=True, max_outage=60, on_outage=events.append)
    finally:
        for restarter in restarters:
            restarter.join()
        router.stop()
        for replica in restarted:
            replica.stop()
    failed = [r for r in results if not isinstance(r, SampleOutput)]
    assert len(results) == 160 and failed == [], failed[:3]
    assert [e.kind for e in events][:1] == ["held"] and "back" in [e.kind for e in events]
    held = [e.error for e in events if e.kind == "held"]
    assert all(isinstance(e, EngineStatusError) and e.status in (500, 503) for e in held), held


def _request_of(results: List[Any], index: int) -> SampleRequest:
    return SampleRequest([7, 8, index % 200], adapter="steady")
