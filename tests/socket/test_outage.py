"""Long jobs across engine outages: a FakeEngine in its own process, killed and restarted on its port.

The CLI runs in a subprocess (``LORA_SAMPLER_TESTING=1``: retry waits are 0 s, probe waits are real). Every engine
and CLI process is stopped by the test that started it. Bounds on durations are generous: the machine is loaded.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest
from _waits import wait_until
from test_cli import WAIT_SECONDS, ids, main, records, running_cli, sample_args, wait_for_lines, write_prompts

from lora_sampler import SampleOutput, SamplerClient, SampleRequest
from lora_sampler._client.outage import OutageEvent
from lora_sampler.errors import EngineConnectionError
from lora_sampler.publish import default_adapter_name
from lora_sampler.testing import write_adapter_archive
from lora_sampler.testing._serve import EngineProcess

#: The issue's batch: 3,000 lines, 10 ms per request, 16 in flight, killed at about 25 %.
LINES, LATENCY, CONCURRENCY = 3000, 0.01, 16
#: Seconds the engine stays dead before it is started again on the same port.
RESTART_AFTER = 3.0
#: Prompts a request in the jobs killed after their first lines.
PROMPTS_PER_REQUEST = 8
#: Upper bound for a job that waits out a 5 s outage limit: 5 s plus one probe, with room for a loaded machine.
GAVE_UP_WITHIN = 30.0


@pytest.fixture
def engine(lora_dir: Path) -> Iterator[EngineProcess]:
    """A FakeEngine (10 ms per completion) in a process of its own; stopped after the test."""
    with EngineProcess(str(lora_dir), latency=LATENCY) as running:
        yield running


def cli_args(engine: EngineProcess, lora_dir: Path, adapter: str, inp: Path, out: Path, *more: str) -> List[str]:
    """The argv of a quiet ``sample`` run at the issue's concurrency."""
    return sample_args(engine, lora_dir, adapter, inp, out, "--concurrency", str(CONCURRENCY), *more)


def kill_mid_run(engine: EngineProcess, out: Path, proc: subprocess.Popen[bytes]) -> None:
    """Kill ``engine`` once the job wrote its first lines and waits on the engine for the rest (held).

    10 requests go through, each of 1 to ``PROMPTS_PER_REQUEST`` prompts as the job grouped them: 10 to 80 lines, and
    with what is in flight and read ahead (16 workers) far from the job's 600.
    """
    engine.hold(after=10)
    wait_for_lines(out, 10, proc)
    engine.wait_for_held()
    engine.kill()


def assert_every_id_once(out: Path, count: int) -> None:
    """The output holds exactly one answered line per input id."""
    got = ids(out)
    assert sorted(got) == sorted(f"p{n}" for n in range(1, count + 1))
    assert [r for r in records(out) if "error" in r] == []


def test_cli_batch_outlives_an_engine_restart_and_heals_the_forgotten_adapter(
    engine: EngineProcess, lora_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL at ~25 % of 3,000 lines, restart 3 s later on the same port: exit 0, every id once, no error row.

    The restarted engine has forgotten the adapter and its resolver sees the folder late, so the held requests
    run again through the adapter-load race (404, proactive load, success). The restart waits until the CLI said it
    holds its requests too (at least 3 s of downtime, however slow the machine is to notice).
    """
    inp, out = write_prompts(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
    name = default_adapter_name(archive)
    restarted: Optional[EngineProcess] = None
    try:
        # The 3,000 requests (one line each): batched 32 to a request, the job is ~100 requests and can end
        # before the kill lands.
        args = cli_args(engine, lora_dir, archive, inp, out, "--prompts-per-request", "1")
        engine.hold(after=LINES // 4)  # the rest wait in flight: the kill lands mid-run, however fast the machine
        with running_cli(args, tmp_path) as proc:
            wait_for_lines(out, LINES // 4, proc)
            engine.wait_for_held()
            engine.kill()
            killed = time.monotonic()
            killed_at = len(ids(out))
            said = tmp_path / "cli.stderr"
            wait_until(lambda: "engine unreachable since" in said.read_text(), "the CLI held its requests")
            time.sleep(max(0.0, killed + RESTART_AFTER - time.monotonic()))  # the engine's downtime, not a wait
            restarted = engine.restart(hidden={name: 3})
            assert proc.wait(timeout=WAIT_SECONDS * 2) == 0, (tmp_path / "cli.stderr").read_text()
        log = restarted.requests()
    finally:
        if restarted is not None:
            restarted.stop()
    assert killed_at < LINES  # it really was mid-run
    assert_every_id_once(out, LINES)
    stderr = (tmp_path / "cli.stderr").read_text()
    assert "engine unreachable since" in stderr and "waiting up to 600 s" in stderr, stderr
    raced = [r for r in log if r["path"] == "/v1/completions" and r["model"] == name and r["status"] == 404]
    loads = [r for r in log if r["path"] == "/v1/load_lora_adapter" and r["model"] == name]
    assert raced and loads, "the restarted engine never went through the adapter-load race"


def test_cli_engine_that_never_comes_back_exits_2_after_max_outage_then_resumes(lora_dir: Path, tmp_path: Path) -> None:
    """``--max-outage 5`` with the engine gone for good: exit 2 in about 5 s, saying so; a rerun later completes.

    The job is still running when the engine dies: the engine holds its requests after its first lines (at the
    default 32 prompts per request and 10 ms a request, the whole job was once done before the kill and exited 0).
    """
    count = 600
    inp, out = write_prompts(tmp_path / "in.jsonl", count), tmp_path / "out.jsonl"
    with EngineProcess(str(lora_dir)) as engine:
        archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
        more = ("--max-outage", "5", "--prompts-per-request", str(PROMPTS_PER_REQUEST))
        args = cli_args(engine, lora_dir, archive, inp, out, *more)
        with running_cli(args, tmp_path) as proc:
            kill_mid_run(engine, out, proc)
            killed = time.monotonic()
            status = proc.wait(timeout=WAIT_SECONDS)
            took = time.monotonic() - killed
        stderr = (tmp_path / "cli.stderr").read_text()
        assert status == 2, stderr
        assert 5.0 <= took < GAVE_UP_WITHIN, took
        assert "unreachable for" in stderr and "--max-outage 5" in stderr and "resume" in stderr, stderr
        assert len(set(ids(out))) == len(ids(out)) < count  # stopped mid-run, each line written once
        with engine.restart() as again:
            assert main(cli_args(again, lora_dir, archive, inp, out)) == 0
    assert_every_id_once(out, count)


@contextlib.contextmanager
def hung_engine() -> Iterator[str]:
    """A server that accepts connections (the kernel's backlog) and never answers; yields its URL."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_cli_hung_engine_is_reported_within_its_timeouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine that accepts and never answers is reported by the preflight in seconds, naming --timeout."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 10), tmp_path / "out.jsonl"
    with hung_engine() as url:
        args = ["sample", "--base-url", url, "--base-model", "tiny-base", "--input", str(inp), "--output", str(out)]
        started = time.monotonic()
        assert main([*args, "--timeout", "2,2"]) == 2
        short = time.monotonic() - started
        started = time.monotonic()
        assert main(args) == 2  # the default read timeout (300 s) is not what the preflight waits
        default = time.monotonic() - started
    err = capsys.readouterr().err
    assert short < GAVE_UP_WITHIN and default < GAVE_UP_WITHIN, (short, default)
    assert err.count("lora-sampler: error:") == 2 and "did not answer" in err and "--timeout" in err, err
    assert records(out) == [] if out.exists() else True


def test_sample_many_with_max_outage_returns_every_result_across_a_restart(
    engine: EngineProcess, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The library: ``sample_many(max_outage=30)`` across a kill and a restart returns every result, in order.

    The engine is restarted once the client holds its first request (not after a fixed time: on a loaded machine the
    first request after the kill went out after a timed restart had already brought the engine back, and no outage
    was seen).
    """
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
    events: List[OutageEvent] = []
    restarted: List[EngineProcess] = []

    def rows() -> Iterator[SampleRequest]:
        for i in range(400):
            if i == 100:
                engine.kill()  # imap pulls rows lazily: this is mid-batch
            yield SampleRequest([5 + i % 200] * (1 + i % 7), adapter=archive, prompt_logprobs=True)

    def restart_once_held(event: OutageEvent) -> None:
        events.append(event)
        if event.kind == "held" and [e.kind for e in events].count("held") == 1:
            threading.Thread(target=lambda: restarted.append(engine.restart())).start()

    try:
        with SamplerClient(engine.url, lora_base_dir=str(lora_dir), max_workers=8) as client:
            results = client.sample_many(rows(), return_exceptions=True, max_outage=30, on_outage=restart_once_held)
    finally:
        deadline = time.monotonic() + WAIT_SECONDS
        while not restarted and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in restarted:
            process.stop()
    failures = [r for r in results if not isinstance(r, SampleOutput)]
    assert len(results) == 400 and failures == [], failures[:3]
    lengths = [len(r.prompt_logprobs or ()) for r in results]
    assert lengths == [1 + i % 7 for i in range(400)]  # input order: each result has its own prompt's length
    kinds = [e.kind for e in events]
    assert kinds[0] == "held" and "back" in kinds and "gave_up" not in kinds, kinds


def test_wait_ready_raises_engine_connection_error_naming_the_wait(tmp_path: Path) -> None:
    """``wait_ready`` returns at once on a live engine and raises ``EngineConnectionError`` on a dead one."""
    with EngineProcess(str(tmp_path)) as live:
        with SamplerClient(live.url) as client:
            client.wait_ready(5)
        url = live.url
    with SamplerClient(url) as client:
        started = time.monotonic()
        with pytest.raises(EngineConnectionError, match=r"did not answer within 1 s"):
            client.wait_ready(1)
        assert time.monotonic() - started < GAVE_UP_WITHIN


def test_ray_data_sample_batches_wait_out_an_engine_restart(
    engine: EngineProcess, no_waits: None, caplog: pytest.LogCaptureFixture
) -> None:
    """``ClientSettings(max_outage=...)``: a batch sent while the engine restarts is answered row by row (no Ray).

    Retry waits are 0 s, so without the hold every row would fail long before the engine is back. The engine
    restarts once the batch's client logged that it holds requests (not after a fixed time: a slow batch could start
    after a timed restart and see no outage).
    """
    from lora_sampler.ray_data import ClientSettings, SampleBatches

    restarted: List[EngineProcess] = []
    batches = SampleBatches(ClientSettings(engine.url, max_workers=4, max_outage=30), base_model=engine.model)

    def restart_once_held() -> None:
        try:
            wait_until(
                lambda: any("engine unreachable since" in r.getMessage() for r in list(caplog.records)),
                "the batch's client held its requests",
            )
        finally:  # restarted even so: the batch ends, and the assertions say what went wrong
            restarted.append(engine.restart())

    try:
        engine.kill()
        restarter = threading.Thread(target=restart_once_held)
        restarter.start()
        columns = batches.sample_rows([[5, 6, i] for i in range(40)], [None] * 40)
        restarter.join()
    finally:
        batches.close()
        for process in restarted:
            process.stop()
    assert columns["error"] == [None] * 40, [e for e in columns["error"] if e][:3]
    with pytest.raises(ValueError, match="max_outage"):
        ClientSettings(engine.url, max_outage=-1)


def test_cli_max_outage_0_keeps_failing_fast(lora_dir: Path, tmp_path: Path) -> None:
    """``--max-outage 0``: a killed engine stops the job after a few failures (exit 2), the old way."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 600), tmp_path / "out.jsonl"
    with EngineProcess(str(lora_dir)) as engine:
        archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
        more = ("--max-outage", "0", "--prompts-per-request", str(PROMPTS_PER_REQUEST))
        with running_cli(cli_args(engine, lora_dir, archive, inp, out, *more), tmp_path) as proc:
            kill_mid_run(engine, out, proc)
            assert proc.wait(timeout=WAIT_SECONDS) == 2
    stderr = (tmp_path / "cli.stderr").read_text()
    assert "consecutive failures" in stderr and "engine unreachable since" not in stderr, stderr


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--timeout", "abc"], "--timeout: takes CONNECT,READ"),
        (["--timeout", "1,2,3"], "--timeout: takes CONNECT,READ"),
        (["--timeout", "0,5"], "--timeout: takes CONNECT,READ"),
        (["--max-outage", "-1"], "--max-outage must be a number of seconds >= 0"),
        (["--max-outage", "inf"], "--max-outage takes a finite number of seconds"),
    ],
)
def test_cli_bad_timeout_or_max_outage_is_a_usage_error(
    flags: List[str], phrase: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad ``--timeout`` or ``--max-outage`` exits 2 with a message naming the flag, before any request."""
    inp = write_prompts(tmp_path / "in.jsonl", 1)
    args = ["sample", "--base-url", "http://127.0.0.1:9", "--base-model", "m", "--input", str(inp), *flags]
    assert main(args) == 2
    assert phrase in capsys.readouterr().err
