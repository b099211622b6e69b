"""The ``lora-sampler`` command line end to end against a FakeEngine on loopback.

Most cases call ``main([...])`` in process; the kill, SIGINT, stdin and demo cases run real subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from _waits import wait_until

from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS = "/v1/completions"
#: Upper bound on any wait for a subprocess (never reached when things work).
WAIT_SECONDS = 60.0


@pytest.fixture
def archive(tmp_path: Path, engine: FakeEngine) -> str:
    """An adapter archive made for the engine's model."""
    return write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)


def write_prompts(path: Path, count: int, *, extra: Optional[Dict[int, str]] = None) -> Path:
    """Write ``count`` prompt lines with ids ``p1..pN``; ``extra`` replaces given line numbers by raw text."""
    with path.open("w", encoding="utf-8") as f:
        for number in range(1, count + 1):
            if extra and number in extra:
                f.write(extra[number] + "\n")
            else:
                f.write(json.dumps({"id": f"p{number}", "prompt": [5 + number % 200, 6, 7]}) + "\n")
    return path


def records(path: Path) -> List[Dict[str, Any]]:
    """Read an output file; every line must be complete JSON."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def ids(path: Path) -> List[Any]:
    """The ids of an output file, in file order."""
    return [r["id"] for r in records(path)]


def sample_args(
    engine: FakeEngine, lora_dir: Path, adapter: str, inp: Path, out: Path, *more: str, quiet: bool = True
) -> List[str]:
    """The argv of a ``sample`` run."""
    return [
        "sample",
        "--base-url",
        engine.url,
        "--lora-base-dir",
        str(lora_dir),
        "--adapter",
        adapter,
        "--input",
        str(inp),
        "--output",
        str(out),
        *(["--quiet"] if quiet else []),
        *more,
    ]


def subprocess_env(**extra: str) -> Dict[str, str]:
    """The environment of a CLI subprocess: the repo importable, retry waits off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["LORA_SAMPLER_TESTING"] = "1"
    env.update(extra)
    return env


def start_cli(args: List[str], tmp_path: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``python -m lora_sampler ARGS`` with stdout/stderr in files (no pipe can fill up)."""
    stdout = (tmp_path / "cli.stdout").open("wb")
    stderr = (tmp_path / "cli.stderr").open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "lora_sampler", *args],
            stdout=stdout,
            stderr=stderr,
            env=subprocess_env(),
            cwd=str(tmp_path),
            **popen,
        )
    finally:
        stdout.close()
        stderr.close()


@contextlib.contextmanager
def running_cli(args: List[str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run the CLI in a subprocess for the block; it is always killed and reaped afterwards."""
    proc = start_cli(args, tmp_path)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def cli_mid_run(
    lora_dir: Path, tmp_path: Path, count: int, answered: int, workers: int, per_request: int
) -> Iterator[Tuple[FakeEngine, List[str], Path, subprocess.Popen[bytes]]]:
    """A ``sample`` job over ``count`` prompts in a subprocess, caught mid-run whatever the machine's speed: the
    engine answered ``answered`` requests (their lines are written) and holds the rest, with every one of the job's
    ``workers`` (``--concurrency``) waiting on it.

    Yields:
        The engine (running for the block), the job's argv (to resume it in process), its output file, the process.
    """
    inp, out = write_prompts(tmp_path / "in.jsonl", count), tmp_path / "out.jsonl"
    with FakeEngine(lora_dir=lora_dir) as engine:
        ckpt = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
        flags = ("--concurrency", str(workers), "--prompts-per-request", str(per_request))
        args = sample_args(engine, lora_dir, ckpt, inp, out, *flags)
        engine.hold(after=answered)
        with running_cli(args, tmp_path) as proc:
            engine.wait_for_held(workers, timeout=WAIT_SECONDS)
            wait_for_lines(out, answered, proc)
            yield engine, args, out, proc


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen[bytes]) -> None:
    """Wait (bounded) until ``path`` holds at least ``count`` lines."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        assert proc.poll() is None, "the CLI ended before writing enough lines"
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {count} lines")


def test_cli_sample_runs_a_2000_line_batch(
    engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2,000-line batch answers every id exactly once, exit 0, with a one-line summary."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 2000), tmp_path / "out.jsonl"
    assert main(sample_args(engine, lora_dir, archive, inp, out, "--concurrency", "16", quiet=False)) == 0
    got = records(out)
    assert sorted(r["id"] for r in got) == sorted(f"p{n}" for n in range(1, 2001))
    assert all("error" not in r and len(r["sequences"]) == 1 for r in got)
    sent = [r.prompts for r in engine.requests if r.path == COMPLETIONS]
    assert sum(sent) == 2000 and len(sent) < 2000 / 8  # each line sent once, many to a request (the default)
    assert "2000 done, 0 failed, 0 skipped" in capsys.readouterr().err


def test_cli_sample_resume_skips_answered_ids(engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path) -> None:
    """Running again with the same output sends nothing for ids already answered."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 30), tmp_path / "out.jsonl"
    assert main(sample_args(engine, lora_dir, archive, inp, out)) == 0
    before = engine.calls(COMPLETIONS)
    assert main(sample_args(engine, lora_dir, archive, inp, out)) == 0
    assert engine.calls(COMPLETIONS) == before
    assert sorted(ids(out)) == sorted(f"p{n}" for n in range(1, 31))


def test_cli_sample_retries_failed_ids_on_resume(
    engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path
) -> None:
    """Ids that failed run again on resume and their error lines go; --no-retry-failed keeps them."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 20), tmp_path / "out.jsonl"
    engine.inject_fault("status", status=500, count=3, message="scripted engine failure")
    one_each = ("--concurrency", "1", "--prompts-per-request", "1")  # a failed request is one line
    assert main(sample_args(engine, lora_dir, archive, inp, out, *one_each)) == 1
    failed = [r for r in records(out) if "error" in r]
    assert len(failed) == 3 and all(r["error"]["status"] == 500 for r in failed)
    assert main(sample_args(engine, lora_dir, archive, inp, out, "--no-retry-failed")) == 1
    assert len([r for r in records(out) if "error" in r]) == 3
    before = len(engine.requests)
    assert main(sample_args(engine, lora_dir, archive, inp, out)) == 0
    resumed = [r for r in engine.requests[before:] if r.path == COMPLETIONS]
    assert sum(r.prompts for r in resumed) == 3  # the 3 failed lines, however the resume groups them in requests
    got = records(out)
    assert sorted(r["id"] for r in got) == sorted(f"p{n}" for n in range(1, 21))
    assert all("error" not in r for r in got)


def test_cli_sample_reports_malformed_lines(
    engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad lines are reported with their numbers and recorded as errors; the rest runs; exit 1."""
    bad = {3: "{not json", 5: json.dumps({"id": "noprompt"}), 8: json.dumps({"id": "neg", "prompt": [-1]})}
    inp, out = write_prompts(tmp_path / "in.jsonl", 10, extra=bad), tmp_path / "out.jsonl"
    assert main(sample_args(engine, lora_dir, archive, inp, out, "--ordered")) == 1
    err = capsys.readouterr().err
    assert "line 3" in err and "line 5" in err and "line 8" in err
    got = records(out)
    assert ids(out) == ["p1", "p2", None, "p4", "noprompt", "p6", "p7", "neg", "p9", "p10"]  # --ordered
    errors = {r["id"]: r["error"] for r in got if "error" in r}
    assert set(errors) == {None, "noprompt", "neg"}  # a line that is not JSON has no id to give
    assert errors[None]["line"] == 3 and "not valid JSON" in errors[None]["message"]
    assert sum(r.prompts for r in engine.requests if r.path == COMPLETIONS) == 7


def test_cli_sample_duplicate_id_is_an_input_error(
    engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A repeated id stops the job with exit 2 and names both line numbers; the output stays one line per id."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 6, extra={5: json.dumps({"id": "p2", "prompt": "x"})}), (
        tmp_path / "out.jsonl"
    )
    assert main(sample_args(engine, lora_dir, archive, inp, out, "--concurrency", "1")) == 2
    err = capsys.readouterr().err
    assert "line 5" in err and "line 2" in err
    assert len(ids(out)) == len(set(ids(out)))


def test_cli_sample_dead_engine_exits_2_at_once(
    lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no engine listening, the preflight fails with one message and exit 2; nothing is written."""
    with FakeEngine() as gone:
        url = gone.url
    inp, out = write_prompts(tmp_path / "in.jsonl", 500), tmp_path / "out.jsonl"
    args = ["sample", "--base-url", url, "--base-model", "tiny-base", "--input", str(inp), "--output", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("lora-sampler: error:") == 1 and url in err
    assert not out.exists() or records(out) == []


def test_cli_sample_stops_early_on_an_unusable_adapter(
    engine: FakeEngine, tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter the engine never finds stops the job after a few failures (exit 2), not after every line."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 300), tmp_path / "out.jsonl"
    args = [
        "sample",
        "--base-url",
        engine.url,
        "--adapter",
        "no-such-adapter",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--concurrency",
        "2",
        "--prompts-per-request",
        "1",
    ]
    assert main(args) == 2
    assert "consecutive failures" in capsys.readouterr().err
    assert len(records(out)) < 50


def test_cli_sample_adapter_for_another_base_model_exits_2(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint made for another model is refused before any completion is sent."""
    wrong = write_adapter_archive(str(tmp_path / "wrong.tar.gz"), "other-model")
    inp, out = write_prompts(tmp_path / "in.jsonl", 5), tmp_path / "out.jsonl"
    assert main(sample_args(engine, lora_dir, wrong, inp, out)) == 2
    err = capsys.readouterr().err
    assert "base_model_name_or_path" in err and "other-model" in err
    assert engine.calls(COMPLETIONS) == 0


def test_cli_sample_unknown_base_model_exits_2(
    engine: FakeEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --base-model the engine does not serve is refused, naming the served model, before any completion."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 5), tmp_path / "out.jsonl"
    argv = ["sample", "--base-url", engine.url, "--base-model", "tiny-bsae", "--input", str(inp), "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'tiny-bsae' is not served" in err and repr(engine.model) in err
    assert engine.calls(COMPLETIONS) == 0


def test_cli_sample_api_key_from_env_is_never_echoed(
    lora_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LORA_SAMPLER_API_KEY is used; a wrong key exits 2; the key never reaches stdout, stderr or the output."""
    secret = "sekrit-key-123"
    inp, out = write_prompts(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl"
    with FakeEngine(lora_dir=lora_dir, api_key=secret) as keyed:
        args = [
            "sample",
            "--base-url",
            keyed.url,
            "--base-model",
            keyed.model,
            "--input",
            str(inp),
            "--output",
            str(out),
        ]
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", secret)
        assert main(args) == 0
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", "wrong-" + secret)
        assert main([*args[:-1], str(tmp_path / "out2.jsonl")]) == 2
    captured = capsys.readouterr()
    assert "401" in captured.err
    assert secret not in captured.out + captured.err + out.read_text(encoding="utf-8")


def test_cli_sample_reads_stdin_and_writes_stdout(engine: FakeEngine, tmp_path: Path) -> None:
    """--input - reads the prompts from stdin; without --output the records go to stdout."""
    data = "".join(json.dumps({"prompt": "hello", "max_tokens": 3}) + "\n" for _ in range(4))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_sampler",
            "sample",
            "--base-url",
            engine.url,
            "--base-model",
            engine.model,
            "--input",
            "-",
            "--ordered",
        ],
        input=data.encode(),
        capture_output=True,
        env=subprocess_env(),
        timeout=WAIT_SECONDS,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    got = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [r["id"] for r in got] == [1, 2, 3, 4]
    assert all(len(r["sequences"][0]["tokens"]) == 3 for r in got)


def test_cli_sample_stdin_in_process(engine: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process too, --input - streams sys.stdin."""
    data = b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": [9, 9]}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "out.jsonl"
    args = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", "-", "--output", str(out)]
    assert main(args) == 0
    assert sorted(ids(out)) == ["a", "b"]


def test_cli_sample_killed_midway_resumes_every_id_once(lora_dir: Path, tmp_path: Path) -> None:
    """A SIGKILLed job plus a torn last line resumes to exactly one answered line per id."""
    count = 300
    # One line a request; the engine answers 20 and holds the rest, so the kill lands mid-run whatever the machine's
    # speed. tests/socket/test_batching.py kills a batched job.
    with cli_mid_run(lora_dir, tmp_path, count, answered=20, workers=4, per_request=1) as (engine, args, out, proc):
        proc.kill()
        proc.wait(timeout=WAIT_SECONDS)
        engine.release()
        assert len(ids(out)) == 20  # it really was mid-run: the 20 answers, no more
        with out.open("a", encoding="utf-8") as f:
            f.write('{"id": "p1", "model": "x", "sequ')  # a torn last line
        assert main(args) == 0
    got = ids(out)
    assert sorted(got) == sorted(f"p{n}" for n in range(1, count + 1))
    assert all("error" not in r for r in records(out))


def test_cli_sample_sigint_exits_130_and_resumes(lora_dir: Path, tmp_path: Path) -> None:
    """SIGINT stops taking lines, exits 130, and leaves a file that resumes to every id once."""
    count = 300
    # 10 answered, the rest held: the interrupt lands mid-run whatever the machine's speed
    with cli_mid_run(lora_dir, tmp_path, count, answered=10, workers=4, per_request=1) as (engine, args, out, proc):
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "interrupted" in (tmp_path / "cli.stderr").read_text(), "the CLI saw the interrupt")
        engine.release()  # the requests in flight end; no new line is taken
        assert proc.wait(timeout=WAIT_SECONDS) == 130
        partial = ids(out)
        assert 10 <= len(partial) < count and len(partial) == len(set(partial))  # the 10, and what was sent already
        assert main(args) == 0
    assert sorted(ids(out)) == sorted(f"p{n}" for n in range(1, count + 1))


def test_cli_sample_second_sigint_abandons_hung_requests(lora_dir: Path, tmp_path: Path) -> None:
    """A second SIGINT leaves requests the engine never answers behind: exit 130 at once, output still resumable."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 50), tmp_path / "out.jsonl"
    with FakeEngine(lora_dir=lora_dir, latency=WAIT_SECONDS * 2) as hung:
        ckpt = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), hung.model)
        args = sample_args(hung, lora_dir, ckpt, inp, out, "--concurrency", "2")
        with running_cli(args, tmp_path) as proc:
            wait_until(lambda: hung.requests_in_flight == 2 or proc.poll() is not None, "both requests in flight")
            assert proc.poll() is None, (tmp_path / "cli.stderr").read_text()
            proc.send_signal(signal.SIGINT)
            # the second one is a second press only once the first was seen (two pending SIGINTs are one)
            wait_until(lambda: "interrupted" in (tmp_path / "cli.stderr").read_text(), "the CLI saw the first SIGINT")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=WAIT_SECONDS) == 130
        assert records(out) == []
        assert "resume" in (tmp_path / "cli.stderr").read_text()


def test_cli_demo_exits_0(tmp_path: Path) -> None:
    """The demo runs without arguments, shows retries in its log, and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "lora_sampler", "demo"],
        capture_output=True,
        env={**subprocess_env(), "LORA_SAMPLER_TESTING": "0"},
        timeout=WAIT_SECONDS,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert "Retrying LoRA adapter" in proc.stderr.decode()
    assert "retries" in proc.stdout.decode()


# -- doctor, publish, unload --------------------------------------------------------------------------------------


def test_cli_doctor_all_ok(
    engine: FakeEngine, lora_dir: Path, archive: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A healthy engine passes every check (exit 0), and the probe adapter is removed."""
    args = ["doctor", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter", archive]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and "resolver folder" in out and "adapter config" in out
    assert os.listdir(lora_dir) == []
    assert engine.calls("/v1/load_lora_adapter") == 0  # the probe is never loaded


def test_cli_doctor_missing_api_key(
    lora_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that wants a key the user did not give: a problem naming the fix."""
    monkeypatch.delenv("LORA_SAMPLER_API_KEY", raising=False)
    with FakeEngine(lora_dir=lora_dir, api_key="k") as keyed:
        assert main(["doctor", "--base-url", keyed.url]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  api key: no API key was sent" in out and "LORA_SAMPLER_API_KEY" in out


def test_cli_doctor_key_from_environment(
    lora_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key from LORA_SAMPLER_API_KEY is used and reported as sent: accepted, or refused when wrong."""
    with FakeEngine(lora_dir=lora_dir, api_key="k") as keyed:
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", "k")
        main(["doctor", "--base-url", keyed.url])
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", "sk-env-wrong-123")
        assert main(["doctor", "--base-url", keyed.url]) == 1
    out = capsys.readouterr().out
    assert "ok       api key: accepted" in out and "PROBLEM  api key: the API key given was refused" in out
    assert "sk-env-wrong-123" not in out


def test_cli_doctor_runtime_updating_off(
    engine: FakeEngine, lora_dir: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runtime LoRA updating off is reported with the environment variable to set."""
    engine.set_runtime_lora_updating(False)
    assert main(["doctor", "--base-url", engine.url, "--lora-base-dir", str(lora_dir)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  runtime LoRA updating: off" in out
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in out
    assert "PROBLEM  resolver folder" in out
    assert os.listdir(lora_dir) == []


def test_cli_doctor_base_model_mismatch(engine: FakeEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter made for another base model is reported with both names, and the archive member it read."""
    wrong = write_adapter_archive(str(tmp_path / "wrong.tar.gz"), "other-model")
    assert main(["doctor", "--base-url", engine.url, "--adapter", wrong]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  adapter config" in out and "other-model" in out and repr(engine.model) in out
    assert f"{wrong}:adapter_config.json has base_model_name_or_path='other-model'" in out


@pytest.mark.parametrize(("layout", "ok"), [(["a/"], True), (["a/", "b/"], False), ([""], True)])
def test_doctor_finds_an_archive_config_where_publish_does(tmp_path: Path, layout: List[str], ok: bool) -> None:
    """The doctor reads an archive's adapter_config.json where publishing looks (the root, else the one top-level
    folder): an archive whose config sits in one of two top-level folders, which publish refuses, is a problem."""
    from lora_sampler.doctor import check_adapter

    with tarfile.open(tmp_path / "ckpt.tar", "w") as tar:
        for folder in layout:
            config = json.dumps({"peft_type": "LORA", "base_model_name_or_path": "m"}).encode()
            member = tarfile.TarInfo(folder + ("adapter_config.json" if folder == layout[0] else "weights"))
            member.size = len(config)
            tar.addfile(member, io.BytesIO(config))
    finding = check_adapter(str(tmp_path / "ckpt.tar"), None, "m")
    assert finding.ok is ok, finding.detail
    assert ok or "no adapter_config.json at its root or inside a single top-level folder (found: ['a', 'b'])" in (
        finding.detail
    )


def test_cli_doctor_wrong_resolver_folder(
    engine: FakeEngine, tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder the engine does not read is reported (the probe gets a 404)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert main(["doctor", "--base-url", engine.url, "--lora-base-dir", str(elsewhere)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  resolver folder" in out and "VLLM_LORA_RESOLVER_CACHE_DIR" in out


def test_cli_doctor_dead_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No engine: one problem, with the fix."""
    with FakeEngine() as gone:
        url = gone.url
    assert main(["doctor", "--base-url", url]) == 1
    assert "PROBLEM  engine" in capsys.readouterr().out


def test_cli_publish_and_unload_print_the_name(
    engine: FakeEngine, lora_dir: Path, archive: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """publish prints the adapter name; unload --delete-files unloads it and removes its folder."""
    assert main(["publish", archive, "--lora-base-dir", str(lora_dir), "--base-url", engine.url]) == 0
    name = capsys.readouterr().out.strip()
    assert (lora_dir / name / "adapter_config.json").is_file()
    args = ["unload", name, "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--delete-files"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == name
    assert not (lora_dir / name).exists()


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Missing flags are usage errors (exit 2); --help exits 0 and names the API key variable."""
    assert main(["sample", "--base-url", "http://127.0.0.1:1"]) == 2
    assert main(["sample", "--help"]) == 0
    assert "LORA_SAMPLER_API_KEY" in capsys.readouterr().out


def test_cli_sample_integer_ids_and_a_bad_line_never_collide(
    engine: FakeEngine, lora_dir: Path, archive: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ids 0..N-1 (as enumerate numbers them) and one line that is not JSON at line 5: every good line is answered,
    the bad one is an error row, and a second run retries only that line (it used to be keyed by its line number,
    so line 6's id 5 "repeated" it: exit 2 with 5 of 200 rows, every run)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": number, "prompt": [5, 6]}) for number in range(200)]
    lines.insert(4, "{this is not json")
    inp.write_text("\n".join(lines) + "\n")
    for _ in range(2):
        assert main(sample_args(engine, lora_dir, archive, inp, out)) == 1
        got = records(out)
        assert sorted(r["id"] for r in got if "error" not in r) == list(range(200))
        assert [r["error"]["line"] for r in got if "error" in r] == [5]
    assert "repeats the id" not in capsys.readouterr().err
    assert sum(r.prompts for r in engine.requests if r.path == COMPLETIONS) == 200  # the second run sent nothing again
