"""Run the socket suite on a loaded machine, several times in a row: a test that depends on the machine's speed fails.

Two CPU-bound processes at normal priority run beside pytest for the whole run (each busy-loops on one core), so
every thread of the tests and of their engines gets less CPU than on an idle machine, and the races a test leaves
open (a kill that lands after the job ended, an overlap that did not happen, a grouping that changed) come out.
A test that passes here waits for what it waits for, with a generous deadline. ``.ci/run`` runs this once.

Usage: ``python tests/loaded_run.py [--runs N] [--load N] [PYTEST ARGS...]``; the pytest arguments default to
``tests/socket`` with two pytest-xdist workers when pytest-xdist is installed, printing the ten slowest tests. The exit
status is 0 when every run passed, else 1; each run's outcome and wall time is printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parent.parent
BUSY_LOOP = "while True: pass"


def default_pytest_args() -> List[str]:
    """The socket suite, on two xdist workers when pytest-xdist is there (as the py3x tox envs run it)."""
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") is not None else []
    return [*workers, "--durations=10", "tests/socket"]


def start_load(count: int) -> List[subprocess.Popen[bytes]]:
    """Start ``count`` busy-looping Python processes at normal priority."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


def stop_load(load: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill the busy loops started by ``start_load`` and reap them."""
    for process in load:
        process.kill()
    for process in load:
        process.wait()


def run_suite(pytest_args: Sequence[str]) -> int:
    """One run of pytest in the repository's root, in its own process group (its xdist workers too); its exit status.

    Stopped early (Ctrl-C, SIGTERM), the whole group is terminated and reaped before this returns.
    """
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    suite = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        return suite.wait()
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGTERM)
            suite.wait()


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through the finally blocks: the busy loops and the suite are stopped


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite ``--runs`` times beside ``--load`` busy loops; 0 when every run passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs in a row (default 3)")
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes beside the suite (default 2)")
    options, pytest_args = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background, where it is ignored
    pytest_args = pytest_args or default_pytest_args()
    outcomes = []
    load = start_load(options.load)
    try:
        for run in range(1, options.runs + 1):
            print(
                f"loaded_run: run {run}/{options.runs} with {options.load} busy loops: pytest {' '.join(pytest_args)}"
            )
            sys.stdout.flush()
            started = time.monotonic()
            status = run_suite(pytest_args)
            outcomes.append((status, time.monotonic() - started))
    finally:
        stop_load(load)
    for run, (status, seconds) in enumerate(outcomes, 1):
        print(f"loaded_run: run {run}: {'passed' if status == 0 else f'FAILED (exit {status})'} in {seconds:.0f} s")
    return 0 if outcomes and all(status == 0 for status, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
