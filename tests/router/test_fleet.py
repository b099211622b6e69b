"""``replicas="router"``: 16 FakeEngine replicas WITHOUT a resolver, 0.5 s per load, behind a real vllm-router.

Such replicas (SGLang; vLLM without the resolver plugin; any replica that just restarted) serve an adapter only
once it was loaded on them, and the router forwards a load to one replica only. Measured before fleet mode: 64
first requests for a new adapter, 6 failed. One module-scoped fleet serves every test (each test uses
adapters of its own); the retry waits are real, so a test sees what a user sees. Run with ``tox -e router``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

import pytest
import requests
import urllib3
from _fleet import BASE_MODEL, Replica, Router, start_replicas
from requests.adapters import HTTPAdapter

from lora_sampler import FleetError, SampleOutput, SamplerClient, SampleRequest
from lora_sampler.testing import write_adapter

pytestmark = pytest.mark.router

REPLICAS = 16
LOAD_SECONDS = 0.5
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: Any) -> str:
    """The adapter folder every replica reads (only through loads: no replica resolves from it)."""
    return str(tmp_path_factory.mktemp("fleet-loras"))


@pytest.fixture(scope="module")
def fleet(fleet_dir: str) -> Iterator[List[Replica]]:
    """16 resolver-less replicas, 0.5 s per load; a test that restarts one puts the new one in its place."""
    replicas = start_replicas(REPLICAS, fleet_dir, latency=0.01, load_latency=LOAD_SECONDS, resolver=False)
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def router(fleet: List[Replica]) -> Iterator[Router]:
    # A circuit opened by a killed replica closes again after 2 s (default 60 s), so its sessions come back soon.
    started = Router([r.url for r in fleet], extra=["--cb-timeout-duration-secs", "2"])
    try:
        yield started
    finally:
        started.stop()


def _client(router: Router, fleet_dir: str, **kwargs: Any) -> SamplerClient:
    return SamplerClient(router.url, lora_base_dir=fleet_dir, replicas="router", max_workers=32, **kwargs)


def _loads(replica: Replica, name: str) -> List[Dict[str, Any]]:
    return [r for r in replica.requests() if r["path"] == LOAD and r["model"] == name]


def _completions(replica: Replica) -> List[Dict[str, Any]]:
    return [r for r in replica.requests() if r["path"] == "/v1/completions" and r["status"] == 200]


def _checkpoint(tmp_path: Any, name: str) -> str:
    return write_adapter(os.path.join(str(tmp_path), name), BASE_MODEL)


def _failures(results: List[Any]) -> List[Any]:
    return [r for r in results if not isinstance(r, SampleOutput)]


def test_fleet_64_first_requests_for_an_unpublished_adapter_all_succeed(
    router: Router, fleet: List[Replica], fleet_dir: str
) -> None:
    """The issue's reproduction: an adapter in the folder, loaded nowhere; 64 first requests (6 failed before).

    The first retriable failure reconciles the fleet: every replica gets exactly one load, and no request fails.
    """
    write_adapter(os.path.join(fleet_dir, "first"), BASE_MODEL)
    with _client(router, fleet_dir) as client:
        assert sorted(client.replicas()) == sorted(r.url for r in fleet)
        results = client.sample_many(
            [{"prompt": [5, 6, i], "adapter": "first"} for i in range(64)], return_exceptions=True
        )
    assert _failures(results) == []
    assert [len(_loads(r, "first")) for r in fleet] == [1] * REPLICAS
    assert all("first" in r.command("loaded") for r in fleet)


def test_fleet_publish_loads_every_replica_once_in_about_one_load_time_then_256_requests_succeed(
    router: Router, fleet: List[Replica], fleet_dir: str, tmp_path: Any
) -> None:
    """publish returns once every replica lists the adapter, in parallel (not 16 load times); then 0 failures."""
    checkpoint = _checkpoint(tmp_path, "published")
    with _client(router, fleet_dir) as client:
        client.engine_model()  # the preflight's GET /v1/models, outside the timed part
        started = time.monotonic()
        adapter = client.publish(checkpoint)
        took = time.monotonic() - started
        assert all(adapter.name in r.command("loaded") for r in fleet)  # listed on every replica on return
        results = client.sample_many(
            [{"prompt": [7, i], "adapter": adapter} for i in range(256)], return_exceptions=True
        )
    assert _failures(results) == []
    assert [len(_loads(r, adapter.name)) for r in fleet] == [1] * REPLICAS
    assert all(load["status"] == 200 for r in fleet for load in _loads(r, adapter.name))
    # Loose on purpose (a loaded 2-core machine): serial loads would take 16 x 0.5 s. The figure is in the benchmark.
    assert took < 4 * LOAD_SECONDS, f"publish took {took:.2f} s for {REPLICAS} replicas"


def test_fleet_replica_killed_and_restarted_on_its_port_mid_run_costs_no_request(
    router: Router, fleet: List[Replica], fleet_dir: str, tmp_path: Any
) -> None:
    """A replica restarts mid-run and has forgotten the adapter: the race reconciles it, no request fails."""
    victim = 5
    with _client(router, fleet_dir) as client:
        adapter = client.publish(_checkpoint(tmp_path, "steady"))

        def rows() -> Iterator[SampleRequest]:
            for i in range(400):
                if i == 100:
                    fleet[victim].kill()
                    fleet[victim] = fleet[victim].restart()  # same port: the router's URL, an empty adapter table
                yield SampleRequest([9, i % 200], adapter=adapter)

        results = client.sample_many(rows(), return_exceptions=True)
        # The router sends the restarted replica its sessions again once it is healthy (and its circuit closed).
        deadline = time.monotonic() + 60
        while not _completions(fleet[victim]) and time.monotonic() < deadline:
            results += client.sample_many(
                [SampleRequest([9, i], adapter=adapter) for i in range(64)], return_exceptions=True
            )
    assert _failures(results) == []
    assert _completions(fleet[victim]), "the router never sent the restarted replica a request"
    assert adapter.name in fleet[victim].command("loaded")
    assert len(_loads(fleet[victim], adapter.name)) == 1  # the fresh process: one reconciliation load


def test_fleet_unload_with_delete_files_deletes_only_after_every_replica_let_go(
    router: Router, fleet: List[Replica], fleet_dir: str, tmp_path: Any
) -> None:
    """Every replica answered its unload before the folder went, the slowest one (1 s) included."""
    slow = fleet[3]
    slow.command("slow_unload", seconds=1.0)
    with _client(router, fleet_dir) as client:
        adapter = client.publish(_checkpoint(tmp_path, "gone"))
        assert adapter.path is not None
        folder_gone: List[float] = []
        watching = threading.Event()

        def watch() -> None:
            watching.set()
            deadline = time.monotonic() + 60  # bounded: a folder that never goes fails the assertions below
            while os.path.isdir(str(adapter.path)) and time.monotonic() < deadline:
                time.sleep(0.001)
            folder_gone.append(time.monotonic())  # CLOCK_MONOTONIC: the replicas' records use the same clock

        watcher = threading.Thread(target=watch)
        watcher.start()
        watching.wait()
        try:
            client.unload(adapter, delete_files=True)
        finally:
            watcher.join(10)
    assert folder_gone and not os.path.exists(adapter.path)
    unloads = [[u for u in r.requests() if u["path"] == UNLOAD and u["model"] == adapter.name] for r in fleet]
    assert [[u["status"] for u in per] for per in unloads] == [[200]] * REPLICAS
    assert max(per[0]["finished"] for per in unloads) <= folder_gone[0]
    slow_unload = unloads[3][0]
    assert slow_unload["finished"] - slow_unload["started"] >= 1.0
    assert all(adapter.name not in r.command("loaded") for r in fleet)


def test_fleet_replica_with_runtime_updating_off_is_named_and_the_files_stay(
    router: Router, fleet: List[Replica], fleet_dir: str, tmp_path: Any
) -> None:
    """A replica that refuses loads and unloads (runtime updating off): publish and unload name it; nothing lost."""
    refusing: Optional[Replica] = None
    with _client(router, fleet_dir) as client:
        adapter = client.publish(_checkpoint(tmp_path, "kept"))
        refusing = fleet[7]
        refusing.command("runtime", on=False)
        try:
            with pytest.raises(FleetError) as unload_error:
                client.unload(adapter, delete_files=True)
            with pytest.raises(FleetError) as publish_error:
                client.publish(_checkpoint(tmp_path, "refused"))
        finally:
            refusing.command("runtime", on=True)
        assert adapter.path is not None and os.path.isdir(adapter.path)  # not every replica let go: files stay
        for error, verb in ((unload_error.value, "unload"), (publish_error.value, "load")):
            assert list(error.replicas) == [refusing.url], error.replicas
            assert f"{verb} answered HTTP 404: Not Found" in error.replicas[refusing.url]
            assert refusing.url in str(error) and "1 of 16 replicas" in str(error)
        assert "files were left in place" in str(unload_error.value)
        client.unload(adapter, delete_files=True)  # runtime updating back on: every replica confirms
    assert not os.path.exists(adapter.path)


def test_fleet_with_a_users_session_sends_the_router_and_every_replica_through_it(
    router: Router, fleet: List[Replica], fleet_dir: str
) -> None:
    """A user's ``session=`` with ``replicas="router"``: the completions (through the router) and the load on each
    replica all go through that session (its hooks see them), and every request is answered."""
    write_adapter(os.path.join(fleet_dir, "own-session"), BASE_MODEL)
    seen: List[str] = []
    session = requests.Session()
    session.hooks["response"].append(lambda response, **kwargs: seen.append(str(response.url)))
    with session, _client(router, fleet_dir, session=session) as client:
        results = client.sample_many(
            [{"prompt": [9, i], "adapter": "own-session"} for i in range(16)], return_exceptions=True
        )
    assert _failures(results) == []
    assert [len(_loads(r, "own-session")) for r in fleet] == [1] * REPLICAS
    loaded_through_session = {url[: -len(LOAD)] for url in seen if url.endswith(LOAD)}
    assert loaded_through_session == {r.url.rstrip("/") for r in fleet}, (loaded_through_session, seen[:5])
    assert sum(url.startswith(router.url) and url.endswith("/v1/completions") for url in seen) >= 16


def test_fleet_with_a_users_session_retrying_on_one_replica_is_refused_naming_it(
    router: Router, fleet: List[Replica], fleet_dir: str, tmp_path: Any
) -> None:
    """A session whose adapter for one replica's URL retries statuses (the router's URL passed the constructor's
    check) is refused when the fleet first reaches that replica: a ValueError naming it, before any load is sent."""
    session = requests.Session()
    session.mount(fleet[0].url, HTTPAdapter(max_retries=urllib3.Retry(total=3, status_forcelist=[500])))
    checkpoint = _checkpoint(tmp_path, "refused-session")
    with session, _client(router, fleet_dir, session=session) as client:
        with pytest.raises(ValueError) as caught:
            client.publish(checkpoint)
    message = str(caught.value)
    assert fleet[0].url in message and "500" in message, message
