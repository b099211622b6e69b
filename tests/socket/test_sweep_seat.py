"""The sweep from a person's seat: it says what it waits for and why it ended, an idle Ctrl-C says so and is quick,
and --plot in --score mode draws the held-out mean sum (not the input's constant length).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List

import pytest
from _sweeps import make_run, sweep_args, write_prompts
from test_cli import subprocess_env

from lora_sampler.cli import main
from lora_sampler.cli._sweep_runner import plot_panels
from lora_sampler.testing import FakeEngine


def test_watch_over_a_glob_says_what_it_waits_for_and_why_it_ended(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any, no_waits: None
) -> None:
    """--watch with a glob: a line saying it waits for a new checkpoint and for how long, then why it ended.

    The watch starts on a folder with no checkpoint yet, so it waits whatever the machine's speed (with one to sample
    first, a slow sampling could outlast the 0.5 s idle timeout, and the watch end without waiting)."""
    (tmp_path / "run").mkdir()
    inp, out = write_prompts(tmp_path / "p.jsonl", 2), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
    assert main([*argv, "--watch", "--idle-timeout", "0.5", "--settle", "0"]) == 0
    err = capsys.readouterr().err
    make_run(tmp_path / "run", engine.model, (10,))
    assert "waiting for a new checkpoint; the watch ends after 0.5 s with nothing new (--idle-timeout" in err, err
    assert "done: --watch saw nothing new for 0.5 s (--idle-timeout)" in err, err
    assert main(argv) == 0  # without --watch: it says every checkpoint listed was taken
    assert "done: every checkpoint listed was taken" in capsys.readouterr().err


def test_idle_ctrl_c_says_nothing_was_in_flight_and_stops_at_once(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """Ctrl-C while a watch waits: the message says nothing was in flight (not "finishing the requests"), exit 130."""
    (tmp_path / "run").mkdir()
    inp, out = write_prompts(tmp_path / "p.jsonl", 2), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--watch")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_sampler", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first state line: it is waiting
        assert "waiting for a new checkpoint" in line, line
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        waited = time.monotonic() - started
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, err
    assert "nothing was in flight" in err and "finishing the requests in flight" not in err, err
    assert waited < 10, waited  # no drain of requests that do not exist (the figure is in the report, not here)


def test_score_plot_draws_the_held_out_mean_sum() -> None:
    """A scoring ledger plots mean_sum and mean logprob; a sampling one mean logprob and mean length."""
    scored = [{"checkpoint": "a", "mean_logprob": -1.0, "mean_length": 3.0, "mean_sum": -3.0, "step": 1}]
    sampled = [{"checkpoint": "a", "mean_logprob": -1.0, "mean_length": 3.0, "step": 1}]
    assert [key for key, _ in plot_panels(scored)] == ["mean_sum", "mean_logprob"]
    assert [key for key, _ in plot_panels(sampled)] == ["mean_logprob", "mean_length"]


#: The steps of a sweep's end on the terminal, each a name in ``lora_sampler.cli._sweep_runner`` that a Ctrl-C can
#: land in, with the call it lands in: the last (second) checkpoint's line, the progress bar closing, the ledger
#: read back, the table being built.
END_PHASES = {"report_line": 2, "ProgressBar.close": 1, "read_ledger": 1, "summary_table": 1}


@pytest.mark.parametrize("phase", END_PHASES)
def test_ctrl_c_as_the_sweep_ends_exits_130_with_the_table(
    phase: str, engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """A Ctrl-C that lands in any step of the sweep's end: exit 130 with the table of what finished and the resume
    hint, never a traceback. On 00c7ac5, 11 of 12 such Ctrl-Cs exited 130 (6 without the table), 1 exited 0 with a
    KeyboardInterrupt traceback: the handler was gone before the table was read and printed."""
    from lora_sampler.cli import _sweep_runner

    owner, _, name = phase.rpartition(".")
    target = getattr(_sweep_runner, owner) if owner else _sweep_runner
    original = getattr(target, name)
    calls: List[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == END_PHASES[phase]:
            signal.raise_signal(signal.SIGINT)  # delivered here, in the main thread, as a terminal's Ctrl-C is
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, interrupted)
    make_run(tmp_path / "run", engine.model, (10, 20))
    inp, out = write_prompts(tmp_path / "p.jsonl", 3), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--settle", "0")
    assert main(argv) == 130
    printed = capsys.readouterr()
    assert len(calls) >= END_PHASES[phase], f"{phase} was not reached"
    assert "mean logprob" in printed.out and printed.out.count("step-") >= 2, printed.out  # the table, both rows
    assert "run again with --output-dir" in printed.err and "Traceback" not in printed.err, printed.err


def test_ctrl_c_after_the_command_ended_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A Ctrl-C that lands after ``main`` returned (the interpreter shutting down, joining threads) exits 130 at once.
    On 00c7ac5 it raised KeyboardInterrupt there: a traceback, and an exit status that was not 130 (0 when the
    interpreter's shutdown ignored it)."""
    script = (
        "import signal, sys\n"
        "sys.argv = ['lora-sampler', '--version']\n"
        "from lora_sampler.cli import main\n"
        "try:\n"
        "    code = main()\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "signal.raise_signal(signal.SIGINT)  # as the process ends\n"
        "print('went on after the Ctrl-C')\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=60
    )
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "went on" not in done.stdout, done.stderr
