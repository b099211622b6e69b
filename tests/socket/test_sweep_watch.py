"""``lora-sampler sweep`` as a process: SIGKILL at several points then resume, and ``--watch`` on a training run
that is still writing (a slow checkpoint, the manifest's final line). Every CLI runs in its own process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Tuple

import pytest
from _sweeps import aged, ledger_lines, lines_of, make_run, outputs, sweep_args, write_prompts
from _waits import wait_until as wait_for

from lora_sampler._adapters.publish import default_adapter_name
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive
from lora_sampler.testing._serve import EngineProcess

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS = "/v1/completions"
WAIT_SECONDS = 60.0  # upper bound on any wait (never reached when things work)


@contextlib.contextmanager
def cli(args: List[str], cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m lora_sampler ARGS`` in its own process group; the group is always killed afterwards."""
    env = dict(os.environ, LORA_SAMPLER_TESTING="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with (cwd / "cli.stderr").open("ab") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lora_sampler", *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def checkpoints_in(run: Path) -> List[str]:
    """The flags of a quiet sweep of the archives in ``run``."""
    return ["--checkpoints", str(run / "*.tar.gz"), "--quiet"]


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[bytes]) -> bool:
    """Wait (bounded) until ``check()``; False when the process ended first."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if check():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError("the sweep never reached the kill point")


def test_sweep_sigkill_at_several_points_then_resume_answers_every_row_once(
    make_engine: Any, lora_dir: Path, tmp_path: Path
) -> None:
    """Killed mid-checkpoint, right after a ledger line, mid-publish and later: every (checkpoint, id) once.

    Each run is killed while the engine holds one checkpoint's completions, so it is mid-run whatever the machine's
    speed: the first's after 11 answers (at least 10 lines: a warm-up, then 1 to 4 prompts a request, so 60 prompts
    take more than 11 requests), then the third's, the fourth's, the fifth's.
    """
    engine: FakeEngine = make_engine()
    names = [default_adapter_name(path) for path in make_run(tmp_path / "run", engine.model, (1, 2, 3, 4, 5))]
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 60), tmp_path / "out"
    argv = sweep_args(
        engine, lora_dir, inp, out, *checkpoints_in(tmp_path / "run"), "--prompts-per-request", "4", concurrency=4
    )
    ledger = out / "sweep.jsonl"

    kill_points: List[Tuple[str, int, Callable[[], bool]]] = [
        (names[0], 11, lambda: any(len(lines_of(p)) >= 10 for p in outputs(out))),  # inside the first checkpoint
        (names[2], 0, lambda: len(lines_of(ledger)) >= 1),  # just after a ledger line
        (names[3], 0, lambda: len(outputs(out)) >= 3),  # a new checkpoint was just published
        (names[4], 0, lambda: len(lines_of(ledger)) >= 3),
    ]
    for held, answered, point in kill_points:
        engine.hold(model=held, after=answered)
        with cli(argv, tmp_path) as proc:
            assert wait_until(lambda: engine.held_requests >= 1 and point(), proc), (  # noqa: B023 (called here)
                tmp_path / "cli.stderr"
            ).read_text()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        engine.release()
    with cli(argv, tmp_path) as proc:
        assert proc.wait(timeout=WAIT_SECONDS) == 0, (tmp_path / "cli.stderr").read_text()
    entries = lines_of(ledger)
    assert sorted(os.path.basename(e["checkpoint"]) for e in entries) == [f"step-{n}.tar.gz" for n in range(1, 6)]
    assert all(e["rows"] == 60 and e["failed"] == 0 for e in entries)
    for path in outputs(out):
        ids = [record["id"] for record in lines_of(path)]
        assert sorted(ids) == sorted(f"p{n}" for n in range(60)), path.name  # each id exactly once
    assert engine.loaded_adapters == []


def test_sweep_ctrl_c_exits_130_and_the_same_command_resumes(make_engine: Any, lora_dir: Path, tmp_path: Path) -> None:
    """SIGINT mid-sweep: exit 130 with no ledger line for the unfinished checkpoint; running again finishes it.

    The engine answers step-1's first 21 completions (20 lines at least) and holds the rest: the Ctrl-C lands in the
    first checkpoint whatever the machine's speed; the held ones go on once the CLI said it was interrupted."""
    engine: FakeEngine = make_engine()
    first = default_adapter_name(make_run(tmp_path / "run", engine.model, (1, 2))[0])
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 200), tmp_path / "out"
    # 4 prompts a request at most: 50 requests a checkpoint at least
    argv = sweep_args(
        engine, lora_dir, inp, out, *checkpoints_in(tmp_path / "run"), "--prompts-per-request", "4", concurrency=4
    )

    engine.hold(model=first, after=21)
    with cli(argv, tmp_path) as proc:
        assert wait_until(lambda: engine.held_requests >= 1 and any(len(lines_of(p)) >= 20 for p in outputs(out)), proc)
        proc.send_signal(signal.SIGINT)
        assert wait_until(lambda: "interrupted" in (tmp_path / "cli.stderr").read_text(), proc)
        engine.release()
        assert proc.wait(timeout=WAIT_SECONDS) == 130
    assert len(lines_of(out / "sweep.jsonl")) == 0  # nothing finished: nothing recorded
    assert "run again with --output-dir" in (tmp_path / "cli.stderr").read_text()
    with cli(argv, tmp_path) as proc:
        assert proc.wait(timeout=WAIT_SECONDS) == 0
    entries = lines_of(out / "sweep.jsonl")
    assert len(entries) == 2 and all(e["rows"] == 200 for e in entries)


def test_sweep_outlives_an_engine_restart_mid_run(lora_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the engine during the second checkpoint and restart it: exit 0, every (checkpoint, id) once.

    The engine holds step-2's completions until it is killed (so the kill lands mid-sweep whatever the machine's
    speed), and restarts once the CLI said it is unreachable."""
    second = default_adapter_name(make_run(tmp_path / "run", "tiny-base", (1, 2, 3))[1])
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 150), tmp_path / "out"
    engine = EngineProcess(str(lora_dir))
    restarted: List[EngineProcess] = []
    try:
        engine.hold(model=second)
        argv = sweep_args(engine, lora_dir, inp, out, *checkpoints_in(tmp_path / "run"), concurrency=4)
        with cli([*argv, "--max-outage", "60"], tmp_path) as proc:
            engine.wait_for_held(1, timeout=WAIT_SECONDS)
            assert wait_until(lambda: len(lines_of(out / "sweep.jsonl")) >= 1, proc)
            engine.kill()
            assert wait_until(lambda: "engine unreachable since" in (tmp_path / "cli.stderr").read_text(), proc)
            restarted.append(engine.restart())  # same port, every adapter forgotten
            assert proc.wait(timeout=WAIT_SECONDS * 2) == 0, (tmp_path / "cli.stderr").read_text()
    finally:
        for running in [engine, *restarted]:
            running.stop()
    entries = lines_of(out / "sweep.jsonl")
    assert len(entries) == 3 and all(e["rows"] == 150 and e["failed"] == 0 for e in entries)
    for entry in entries:
        assert sorted(r["id"] for r in lines_of(out / entry["output"])) == sorted(f"p{n}" for n in range(150))


def test_sweep_watch_waits_for_a_checkpoint_written_slowly(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A checkpoint written in pieces (with a pause longer than --settle) is evaluated once, and only whole.

    Its first piece appears once the sweep runs step-1 (the engine saw a completion), so the watch finds it mid-run
    whatever the machine's speed; the pauses between pieces are the slow writer under test."""
    run = tmp_path / "run"
    run.mkdir()
    aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model, rank=1))
    whole = Path(write_adapter_archive(str(tmp_path / "whole.tar.gz"), engine.model, rank=2)).read_bytes()
    slow = run / "step-2.tar.gz"

    def write_slowly() -> None:
        try:
            wait_for(lambda: engine.calls(COMPLETIONS) >= 1, "the sweep sent step-1's first completion")
        finally:  # written even so: the watch ends, and the assertions say what went wrong
            with slow.open("wb") as handle:
                for start in range(0, len(whole), len(whole) // 4 + 1):
                    handle.write(whole[start : start + len(whole) // 4 + 1])
                    handle.flush()
                    time.sleep(0.6)  # longer than --settle: settled, but it does not read to its end yet

    writer = threading.Thread(target=write_slowly)
    writer.start()
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 20), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, *checkpoints_in(run), "--watch")
    try:
        assert main([*argv, "--settle", "0.4", "--idle-timeout", "1.5"]) == 0
    finally:
        writer.join()
    entries = lines_of(out / "sweep.jsonl")
    assert [os.path.basename(e["checkpoint"]) for e in entries] == ["step-1.tar.gz", "step-2.tar.gz"]
    assert entries[1]["adapter"] == default_adapter_name(str(slow))  # the whole archive's content name
    assert all(e["rows"] == 20 for e in entries)
    published = sorted(p.name for p in lora_dir.iterdir())
    assert published == sorted(e["adapter"] for e in entries)  # nothing half-written was ever published


def test_sweep_watch_ends_with_the_manifests_final_checkpoint(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A watch on a manifest ends once the line marked final is done, long before --idle-timeout.

    The final line is appended once step-100's ledger line is written: the watch is under way, whatever the machine's
    speed."""
    run = tmp_path / "run"
    run.mkdir()
    manifest = run / "checkpoints.jsonl"
    first = aged(write_adapter_archive(str(run / "step-100.tar.gz"), engine.model, rank=1))
    manifest.write_text(json.dumps({"name": "000100", "batch": 100, "sampler_path": first}) + "\n")
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 10), tmp_path / "out"

    def train() -> None:
        try:
            wait_for(lambda: ledger_lines(out) >= 1, "the sweep finished step-100")
        finally:  # written even so: the watch ends, and the assertions say what went wrong
            final = write_adapter_archive(str(run / "step-200.tar.gz"), engine.model, rank=2)
            with manifest.open("a") as handle:
                handle.write(json.dumps({"name": "final", "batch": 200, "sampler_path": final, "final": True}) + "\n")

    trainer = threading.Thread(target=train)
    trainer.start()
    argv = sweep_args(
        engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", "--watch", "--idle-timeout", "120"
    )
    started = time.monotonic()
    try:
        assert main([*argv, "--settle", "0.2"]) == 0
    finally:
        trainer.join()
    assert time.monotonic() - started < 60  # ended by the final line, not by the idle timeout
    assert [e["step"] for e in lines_of(out / "sweep.jsonl")] == [100, 200]


@pytest.mark.parametrize("window", [1, 3])
def test_sweep_window_one_and_three_answer_everything(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, window: int
) -> None:
    """Other windows run every checkpoint once too."""
    make_run(tmp_path / "run", engine.model, (1, 2, 3, 4))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 15), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, *checkpoints_in(tmp_path / "run"), "--window", str(window))
    assert main(argv) == 0
    assert sorted(e["step"] for e in lines_of(out / "sweep.jsonl")) == [1, 2, 3, 4]
