"""The sweep from a person's seat: it says what it waits for and why it ended, an idle Ctrl-C says so and is quick,
and --plot in --score mode draws the held-out mean sum (not the input's constant length).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from test_cli import subprocess_env
from test_sweep import make_run, sweep_args, write_prompts

from lora_sampler.cli import main
from lora_sampler.cli._sweep_runner import plot_panels
from lora_sampler.testing import FakeEngine


def test_watch_over_a_glob_says_what_it_waits_for_and_why_it_ended(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any, no_waits: None
) -> None:
    """--watch with a glob: a line saying it waits for a new checkpoint and for how long, then why it ended."""
    make_run(tmp_path / "run", engine.model, (10,))
    inp, out = write_prompts(tmp_path / "p.jsonl", 2), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
    assert main([*argv, "--watch", "--idle-timeout", "0.5", "--settle", "0"]) == 0
    err = capsys.readouterr().err
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
