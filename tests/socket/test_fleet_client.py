"""``replicas=``: publish, the race, unload and lineages over several in-process FakeEngines WITHOUT a resolver.

Replicas without a resolver serve an adapter only once it was loaded on them (SGLang; vLLM without the resolver
plugin; a restarted replica). ``base_url`` is the first replica here: what stands in front does not matter to the
adapter lifecycle, which talks to each replica directly. The real router is in tests/router/test_fleet.py.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any, ClassVar, Iterator, List

import pytest

from lora_sampler import FleetError, LoraSamplerError, SampleOutput, SamplerClient
from lora_sampler._adapters.fleet import check_replicas
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def loras(tmp_path: Path) -> Path:
    (tmp_path / "loras").mkdir()
    return tmp_path / "loras"


@pytest.fixture
def replicas(no_waits: None) -> Iterator[List[FakeEngine]]:
    engines = [FakeEngine(load_latency=0.05).start() for _ in range(3)]
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def fleet_client(replicas: List[FakeEngine], loras: Path, **kwargs: Any) -> SamplerClient:
    return SamplerClient(replicas[0].url, lora_base_dir=loras, replicas=[e.url for e in replicas], **kwargs)


def checkpoint(tmp_path: Path, stem: str, model: str = "tiny-base") -> str:
    return write_adapter(tmp_path / "src" / stem, model)


def test_fleet_publish_loads_on_every_replica_once(replicas: List[FakeEngine], loras: Path, tmp_path: Path) -> None:
    """publish returns with the adapter listed on every replica; sampling then needs no retry and no load."""
    with fleet_client(replicas, loras) as client:
        assert client.replicas() == tuple(e.url for e in replicas)
        adapter = client.publish(checkpoint(tmp_path, "step-1"))
        assert all(e.loaded_adapters == [adapter.name] for e in replicas)
        assert client.sample([1, 2], adapter=adapter).sequences
    assert [e.calls(LOAD, adapter.name) for e in replicas] == [1, 1, 1]
    assert replicas[0].calls(COMPLETIONS) == 1


def test_fleet_publish_counts_already_loaded_as_success(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """Publishing again (another client, same content) is no error: 400 "already been loaded" is success."""
    source = checkpoint(tmp_path, "step-2")
    with fleet_client(replicas, loras) as first, fleet_client(replicas, loras) as second:
        assert first.publish(source) == second.publish(source)
    assert all(len(e.loaded_adapters) == 1 for e in replicas)


def test_fleet_publish_names_the_replica_that_cannot_load(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """A replica with runtime updating off is named with its answer; the others serve the adapter."""
    replicas[1].set_runtime_lora_updating(False)
    with fleet_client(replicas, loras) as client, pytest.raises(FleetError) as caught:
        client.publish(checkpoint(tmp_path, "step-3"))
    error = caught.value
    assert list(error.replicas) == [replicas[1].url]
    assert error.replicas[replicas[1].url] == "load answered HTTP 404: Not Found"
    assert replicas[1].url in str(error) and "1 of 3 replicas" in str(error)
    assert replicas[0].loaded_adapters and replicas[2].loaded_adapters


def test_fleet_single_engine_path_sends_no_fleet_request(loras: Path, tmp_path: Path, no_waits: None) -> None:
    """Without replicas=, publish sends no load and a sample is one request: no /list_workers, no extra models."""
    with FakeEngine(lora_dir=loras) as engine, SamplerClient(engine.url, lora_base_dir=loras) as client:
        adapter = client.publish(checkpoint(tmp_path, "step-4"))
        client.sample([1], adapter=adapter)
        assert client.replicas() == (engine.url,)
        assert [r.path for r in engine.requests] == ["/v1/models", COMPLETIONS]


def test_fleet_race_reconciles_every_replica_with_one_load_each(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """48 first requests for an adapter loaded nowhere: one reconciliation at a time, one load per replica."""
    write_adapter(loras / "fresh", "tiny-base")
    for engine in replicas:
        engine.load_latency = 0.3
    with fleet_client(replicas, loras, max_workers=16) as client:
        results = client.sample_many([{"prompt": [i], "adapter": "fresh"} for i in range(48)], return_exceptions=True)
    assert all(isinstance(r, SampleOutput) for r in results), [r for r in results if not isinstance(r, SampleOutput)]
    assert [e.calls(LOAD, "fresh") for e in replicas] == [1, 1, 1]
    assert [e.max_loads_in_flight_for("fresh") for e in replicas] == [1, 1, 1]


def test_fleet_restarted_replica_heals_on_the_next_failure(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """A replica restarted on its port has forgotten the adapter; the next 404 reloads it there only."""
    with fleet_client(replicas, loras) as client:
        adapter = client.publish(checkpoint(tmp_path, "step-5"))
        port = replicas[0].port
        replicas[0].stop()
        replicas[0] = FakeEngine(port=port).start()
        assert client.sample([3], adapter=adapter).sequences  # base_url is the restarted replica
    assert replicas[0].calls(LOAD, adapter.name) == 1 and replicas[0].loaded_adapters == [adapter.name]
    assert [e.calls(LOAD, adapter.name) for e in replicas[1:]] == [1, 1]  # the publish's, no more


def test_fleet_unload_confirmed_everywhere_deletes_the_files(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """200 or 404 "cannot be found" from every replica: the folder goes."""
    with fleet_client(replicas, loras) as client:
        adapter = client.publish(checkpoint(tmp_path, "step-6"))
        with SamplerClient(replicas[1].url) as direct:
            direct.unload(adapter)  # gone from replica 1 already: it will answer 404 "cannot be found"
        client.unload(adapter, delete_files=True)
    assert not (loras / adapter.name).exists()
    assert [[r.status for r in e.requests if r.path == UNLOAD] for e in replicas] == [[200], [200, 404], [200]]
    assert all(e.loaded_adapters == [] for e in replicas)


def test_fleet_unload_unreachable_replica_keeps_the_files(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """A replica that cannot be reached did not confirm: it is named, and the files stay."""
    with fleet_client(replicas, loras) as client:
        adapter = client.publish(checkpoint(tmp_path, "step-7"))
        replicas[2].stop()
        with pytest.raises(FleetError) as caught:
            client.unload(adapter, delete_files=True)
    assert list(caught.value.replicas) == [replicas[2].url]
    assert "could not be reached" in caught.value.replicas[replicas[2].url]
    assert "files were left in place" in str(caught.value)
    assert (loras / adapter.name / "adapter_config.json").exists()


def test_fleet_lineage_retirement_unloads_from_every_replica(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path
) -> None:
    """Once the newer adapter served, the older one of its lineage leaves every replica."""
    with fleet_client(replicas, loras) as client:
        old = client.publish(checkpoint(tmp_path, "s100"), lineage="run")
        client.sample([1], adapter=old)
        new = client.publish(write_adapter(tmp_path / "src" / "s200", "tiny-base", rank=4), lineage="run")
        client.sample([1], adapter=new)
    assert all(e.loaded_adapters == [new.name] for e in replicas)
    assert [e.calls(UNLOAD, old.name) for e in replicas] == [1, 1, 1]


class _StubRouter(http.server.ThreadingHTTPServer):
    """Answers ``GET /list_workers`` as vllm-router 0.1.17 does, with a list the test sets."""

    urls: ClassVar[List[str]] = []


class _StubHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"urls": self.server.urls}).encode()  # type: ignore[attr-defined]
        self.send_response(200 if self.path == "/list_workers" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub_router() -> Iterator[_StubRouter]:
    server = _StubRouter(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_fleet_router_workers_are_read_at_each_need(replicas: List[FakeEngine], loras: Path, stub_router: Any) -> None:
    """replicas="router" asks base_url's /list_workers each time: a worker that joined is seen at once."""
    stub_router.urls = [replicas[0].url + "/"]
    url = f"http://127.0.0.1:{stub_router.server_address[1]}"
    with SamplerClient(url, lora_base_dir=loras, replicas="router") as client:
        assert client.replicas() == (replicas[0].url,)
        stub_router.urls = [e.url for e in replicas]
        assert client.replicas() == tuple(e.url for e in replicas)


def test_fleet_router_that_is_not_a_router_is_a_clear_error(replicas: List[FakeEngine], loras: Path) -> None:
    """replicas="router" on an engine (no /list_workers) says what to pass instead."""
    with SamplerClient(replicas[0].url, replicas="router") as client, pytest.raises(LoraSamplerError) as caught:
        client.replicas()
    assert "/list_workers" in str(caught.value)


@pytest.mark.parametrize(
    "value, error",
    [("routr", ValueError), ("http://a:1", ValueError), ([], ValueError), (5, TypeError), (["ftp://a"], ValueError)],
)
def test_fleet_bad_replicas_value_is_refused_before_any_request(value: Any, error: type) -> None:
    with pytest.raises(error):
        check_replicas(value)
    with pytest.raises(error):
        SamplerClient("http://127.0.0.1:9", replicas=value)


def test_fleet_cli_publish_unload_and_doctor_take_replicas(
    replicas: List[FakeEngine], loras: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--replicas URL,URL: publish loads everywhere, doctor names a refusing replica, unload deletes after all."""
    flags = ["--base-url", replicas[0].url, "--lora-base-dir", str(loras)]
    flags += ["--replicas", ",".join(e.url for e in replicas)]
    assert main(["publish", checkpoint(tmp_path, "cli"), *flags]) == 0
    name = capsys.readouterr().out.strip()
    assert all(e.loaded_adapters == [name] for e in replicas)

    assert main(["doctor", *flags]) == 0, capsys.readouterr().out
    replicas[2].set_runtime_lora_updating(False)
    assert main(["doctor", *flags]) == 1
    report = capsys.readouterr().out
    problems = [line for line in report.splitlines() if line.startswith("PROBLEM")]
    assert problems and all(replicas[2].url in line for line in problems), report
    assert f"ok       {replicas[1].url} adapter folder" in report

    assert main(["unload", name, "--delete-files", *flags]) == 2  # the refusing replica keeps the files
    assert replicas[2].url in capsys.readouterr().err and (loras / name).exists()
    replicas[2].set_runtime_lora_updating(True)
    assert main(["unload", name, "--delete-files", *flags]) == 0
    assert not (loras / name).exists()


def test_fleet_cli_sample_takes_replicas(replicas: List[FakeEngine], loras: Path, tmp_path: Path) -> None:
    """lora-sampler sample --replicas: an adapter loaded nowhere is loaded on every replica by the race; all rows ok."""
    write_adapter(loras / "cli-fresh", "tiny-base")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": [i]}) + "\n" for i in range(40)))
    output = tmp_path / "out.jsonl"
    flags = [
        "--base-url",
        replicas[0].url,
        "--lora-base-dir",
        str(loras),
        "--replicas",
        ",".join(e.url for e in replicas),
    ]
    args = ["sample", "--adapter", "cli-fresh", "--input", str(prompts), "--output", str(output), "--quiet", *flags]
    assert main(args) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 40 and all("error" not in row for row in rows)
    assert [e.calls(LOAD, "cli-fresh") for e in replicas] == [1, 1, 1]
