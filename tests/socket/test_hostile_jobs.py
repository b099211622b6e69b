"""Issue 23's hostile jobs, with real CLI processes against a FakeEngine: two writers, a full disk, bad lines.

Every subprocess runs in its own process group, killed in a ``finally`` whatever the test's outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from test_cli import WAIT_SECONDS, wait_for_lines

from lora_sampler.cli import main
from lora_sampler.retry import DEFAULT_RETRY_POLICY
from lora_sampler.testing import FakeEngine

REPO = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, count: int, extra: Optional[Dict[int, str]] = None) -> Path:
    """Write ``count`` prompt lines with ids ``p1..pN``; ``extra`` replaces given line numbers by raw text."""
    extra = extra or {}
    with path.open("w", encoding="utf-8") as f:
        for number in range(1, count + 1):
            f.write(extra.get(number, json.dumps({"id": f"p{number}", "prompt": [5 + number % 200, 6]})) + "\n")
    return path


def rows(path: Path) -> List[Dict[str, Any]]:
    """Every line of an output file, each complete JSON."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def sample_argv(engine: FakeEngine, inp: Path, out: Path, *more: str) -> List[str]:
    """The argv of a quiet ``sample`` of the engine's base model."""
    base = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp)]
    return [*base, "--output", str(out), "--quiet", *more]


@contextlib.contextmanager
def cli_process(argv: List[str], tmp_path: Path, name: str, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m lora_sampler ARGV`` in its own process group; stderr goes to ``tmp_path/name.err``."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["LORA_SAMPLER_TESTING"] = "1"
    with (tmp_path / f"{name}.err").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lora_sampler", *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=str(tmp_path),
            start_new_session=True,
            **popen,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("second_resumes", [False, True], ids=["fresh", "after-an-error-row"])
def test_jobs_second_writer_on_one_output_is_refused(tmp_path: Path, second_resumes: bool) -> None:
    """A second ``sample`` on a running one's --output exits 2 naming it; the first writes every id exactly once."""
    count = 400
    inp, out = write_prompts(tmp_path / "in.jsonl", count), tmp_path / "out.jsonl"
    if second_resumes:  # an error row makes the second run rewrite the file (the resume), which lost rows before
        out.write_text(
            json.dumps({"id": "p1", "error": {"status": None, "type": "X", "message": "m", "line": 1}}) + "\n"
        )
    # The first run outlives the second's start-up (a Python process importing the CLI takes seconds on a loaded
    # machine): after its first 20 lines the engine holds its requests until the second was refused.
    with FakeEngine() as engine:
        argv = sample_argv(engine, inp, out, "--concurrency", "4", "--prompts-per-request", "1")  # one line a request
        engine.hold(after=20)
        with cli_process(argv, tmp_path, "first") as first:
            wait_for_lines(out, 20, first)
            engine.wait_for_held()
            with cli_process(argv, tmp_path, "second") as second:
                assert second.wait(timeout=WAIT_SECONDS) == 2
            assert first.poll() is None  # the second was refused while the first ran
            engine.release()
            assert first.wait(timeout=WAIT_SECONDS) == 0
    refusal = (tmp_path / "second.err").read_text()
    assert "another run is writing" in refusal and str(out) in refusal
    ids = [row["id"] for row in rows(out) if "error" not in row]
    assert sorted(ids) == sorted(f"p{n}" for n in range(1, count + 1))


def test_jobs_in_process_second_writer_is_refused_while_the_lock_is_held(tmp_path: Path, capsys: Any) -> None:
    """The one-writer lock is the same for a run in this process: main() exits 2 while another holds it."""
    from lora_sampler.batch import one_writer

    inp, out = write_prompts(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl"
    with FakeEngine() as engine, one_writer(str(out)):
        assert main(sample_argv(engine, inp, out)) == 2
    assert "another run is writing" in capsys.readouterr().err and not out.exists()


def _file_size_limit(limit: int) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_jobs_unwritable_output_names_the_path_and_resumes(tmp_path: Path) -> None:
    """A write that fails (a file-size limit standing for a full disk) exits 2 naming the output and its resume."""
    count = 300
    inp, out = write_prompts(tmp_path / "in.jsonl", count), tmp_path / "out.jsonl"
    with FakeEngine() as engine:
        argv = sample_argv(engine, inp, out)
        with cli_process(argv, tmp_path, "full", preexec_fn=_file_size_limit(20_000)) as proc:
            assert proc.wait(timeout=WAIT_SECONDS) == 2
        message = (tmp_path / "full.err").read_text()
        assert f"cannot write the output {out}" in message and "resumable" in message
        assert "Traceback" not in message
        assert main(argv) == 0  # the resume repairs the torn last line and runs the rest
    ids = [row["id"] for row in rows(out)]
    assert sorted(ids) == sorted(f"p{n}" for n in range(1, count + 1))


def test_jobs_a_lone_surrogate_id_is_one_error_row_on_every_run(tmp_path: Path) -> None:
    """A line whose id holds a lone surrogate is an error row; the other 199 are answered; a rerun is the same."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 200, {50: '{"id": "bad\\ud800", "prompt": [1]}'}), tmp_path / "o"
    with FakeEngine() as engine:
        for _ in range(2):
            assert main(sample_argv(engine, inp, out)) == 1
            answered = [row["id"] for row in rows(out) if "error" not in row]
            errors = [row for row in rows(out) if "error" in row]
            assert len(answered) == 199 and len(errors) == 1
            assert errors[0]["id"] is None and errors[0]["error"]["line"] == 50  # its id cannot be written back


def test_jobs_a_first_line_nested_100000_deep_is_an_error_row(tmp_path: Path, capsys: Any) -> None:
    """A first line nested 100,000 deep is an error row and the job goes on (a traceback and exit 2 before)."""
    deep = "[" * 100_000 + "]" * 100_000
    inp, out = write_prompts(tmp_path / "in.jsonl", 20, {1: deep}), tmp_path / "out.jsonl"
    with FakeEngine() as engine:
        assert main(sample_argv(engine, inp, out)) == 1
    errors = [row for row in rows(out) if "error" in row]
    assert len(rows(out)) == 20 and len(errors) == 1 and "nested too deep" in errors[0]["error"]["message"]
    assert "Traceback" not in capsys.readouterr().err


def test_jobs_form_feed_lines_get_a_row(tmp_path: Path) -> None:
    """Lines holding only \\x0b or \\x0c get an error row each; no line vanishes."""
    inp, out = write_prompts(tmp_path / "in.jsonl", 5, {2: "\x0b", 4: "\x0c"}), tmp_path / "out.jsonl"
    with FakeEngine() as engine:
        assert main(sample_argv(engine, inp, out)) == 1
    assert len(rows(out)) == 5
    assert sorted(row["error"]["line"] for row in rows(out) if "error" in row) == [2, 4]


def test_jobs_hung_but_healthy_engine_fails_the_lines_instead_of_holding_them(
    tmp_path: Path, capsys: Any, no_waits: None
) -> None:
    """Completions that never answer while health does: each line fails after the retry table, not held as an outage."""
    count = 8
    inp, out = write_prompts(tmp_path / "in.jsonl", count), tmp_path / "out.jsonl"
    with FakeEngine() as engine:
        engine.inject_fault("hang", count=10**6, seconds=60.0)  # every completion: no answer (ended by the stop)
        # One prompt per request, so that requests count attempts per line (batched, a request holds several lines).
        # The read timeout is also the health probe's: 2 s lets a loaded machine's FakeEngine answer /health in time
        # (at 0.3 s, a probe slower than that read as "away" held the lines: flaky at load 13).
        argv = sample_argv(engine, inp, out, "--timeout", "1,2", "--max-outage", "20", "--concurrency", "8")
        argv += ["--prompts-per-request", "1"]
        assert main(argv) == 2  # consecutive engine-wide failures stop the job
        sent = engine.calls("/v1/completions")
    # The retry table's attempts for each line at most; before, every line was held and re-run while the health
    # probe answered, until --max-outage (852 requests for 100 lines).
    assert sent <= count * DEFAULT_RETRY_POLICY.max_attempts
    err = capsys.readouterr().err
    assert "consecutive failures" in err and "unreachable" not in err
    assert all("error" in row for row in rows(out))
