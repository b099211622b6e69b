"""The sweep under what users do in their first week: each test is one measured failure of the old sweep, redone.

Absent checkpoints (a manifest ahead of its files, a deletion mid-sweep), integer ids with a bad line, waits that a
writer could stretch, symlink loops, two runs sharing one resolver folder, content that changes after evaluation, a
full disk, names with control characters, and manifest paths outside the manifest's folder.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from _sweeps import aged, ledger, ledger_lines, lines_of, make_run, sweep_args, write_prompts
from _waits import wait_until

from lora_sampler import SamplerClient, sweep
from lora_sampler._adapters.lease import hold
from lora_sampler._adapters.publish import default_adapter_name
from lora_sampler.batch import Manifest, _job
from lora_sampler.batch._lines import output_error
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

COMPLETIONS = "/v1/completions"
UNLOAD = "/v1/unload_lora_adapter"


@pytest.fixture
def engine_options() -> Dict[str, Any]:
    return {"latency": 0.002}


def manifest_line(path: str, step: int, final: bool = False) -> str:
    return json.dumps({"name": f"{step:06d}", "sampler_path": path, "batch": step, "final": final}) + "\n"


def step_100_and_manifest(run: Path, model: str, lines: str) -> Path:
    """Write a training run folder with ``step-100.tar.gz`` (settled); return its manifest (``lines``)."""
    make_run(run, model, (100,))
    manifest = run / "checkpoints.jsonl"
    manifest.write_text(lines)
    return manifest


def by_name(entries: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {os.path.basename(entry["checkpoint"]): entry for entry in entries}


# -- absent checkpoints ------------------------------------------------------------------------------------------


def test_manifest_line_ahead_of_its_checkpoint_is_recorded_and_the_rest_runs(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """step-100 present, step-200 not written yet: step-100 runs, step-200 is a CheckpointMissingError line with its
    path, exit 1 (was: IndexError traceback, exit 1 in 0.3 s, nothing run)."""
    manifest = step_100_and_manifest(
        tmp_path / "run", engine.model, manifest_line("step-100.tar.gz", 100) + manifest_line("step-200.tar.gz", 200)
    )
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 5), tmp_path / "out"
    assert main(sweep_args(engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", concurrency=4)) == 1
    got = by_name(ledger(out))
    assert got["step-100.tar.gz"]["rows"] == 5
    error = got["step-200.tar.gz"]["error"]
    assert error["type"] == "CheckpointMissingError" and error["path"] == str(tmp_path / "run" / "step-200.tar.gz")


def test_manifest_line_ahead_of_its_checkpoint_from_python(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The same through ``sweep(client, Manifest(...))``: a failed report with the error type, no exception."""
    manifest = step_100_and_manifest(
        tmp_path / "run", engine.model, manifest_line("step-200.tar.gz", 200) + manifest_line("step-100.tar.gz", 100)
    )
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(sweep(client, Manifest(str(manifest)), [{"prompt": [5, 6]}], output_dir=tmp_path / "out"))
    assert [(r.error or {}).get("type") for r in reports] == ["CheckpointMissingError", None]
    assert reports[1].rows == 1


def test_watch_waits_for_a_manifest_line_ahead_of_its_checkpoint(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Under --watch the absent checkpoint is waited for and evaluated once it is written.

    It is written once step-100's ledger line is: the watch has seen it absent, whatever the machine's speed."""
    manifest = step_100_and_manifest(
        tmp_path / "run",
        engine.model,
        manifest_line("step-100.tar.gz", 100) + manifest_line("step-200.tar.gz", 200, final=True),
    )
    late = write_adapter_archive(str(tmp_path / "late.tar.gz"), engine.model, rank=3)
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 5), tmp_path / "out"

    def write_later() -> None:
        try:
            wait_until(lambda: ledger_lines(out) >= 1, "the sweep finished step-100")
        finally:  # written even so: the watch ends, and the assertions say what went wrong
            os.replace(late, manifest.parent / "step-200.tar.gz")

    writer = threading.Thread(target=write_later)
    writer.start()
    argv = sweep_args(engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", "--watch", concurrency=4)
    try:
        assert main([*argv, "--settle", "0.2", "--checkpoint-timeout", "60"]) == 0
    finally:
        writer.join()
    assert [entry["rows"] for entry in ledger(out)] == [5, 5]


def test_watch_gives_up_on_an_absent_checkpoint_after_the_checkpoint_timeout(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A checkpoint that never comes is recorded once --checkpoint-timeout passed; the watch then ends."""
    run = tmp_path / "run"
    run.mkdir()
    manifest = run / "checkpoints.jsonl"
    manifest.write_text(manifest_line("never.tar.gz", 1, final=True))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", "--watch", concurrency=4)
    started = time.monotonic()
    assert main([*argv, "--checkpoint-timeout", "1", "--idle-timeout", "0.5"]) == 1
    assert time.monotonic() - started < 30  # bounded by the two timeouts, not by anything outside
    (entry,) = ledger(out)
    assert entry["error"]["type"] == "CheckpointMissingError" and "--checkpoint-timeout 1" in entry["error"]["message"]


def test_a_checkpoint_deleted_mid_sweep_is_recorded_not_skipped(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Listed at the start, deleted while the first one runs: a CheckpointMissingError line, exit 1 (was: skipped,
    exit 0, no word)."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 2, 3))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 5), tmp_path / "out"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = []
        for report in sweep(client, str(run / "*.tar.gz"), str(inp), output_dir=out, window=1):
            reports.append(report)
            if len(reports) == 1:
                os.remove(run / "step-3.tar.gz")
    assert [(r.error or {}).get("type") for r in reports] == [None, None, "CheckpointMissingError"]
    assert len(ledger(out)) == 3


# -- ids and bad lines -------------------------------------------------------------------------------------------


def test_sweep_integer_ids_and_a_bad_line(engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None) -> None:
    """Ids 0..199 and a line that is not JSON at line 5: every checkpoint answers 200 rows and records one error row
    (was: "line 6 repeats the id 5 of line 5", 5 rows per checkpoint, exit 2)."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 2))
    lines = [json.dumps({"id": number, "prompt": [5, 6]}) for number in range(200)]
    lines.insert(4, "{not json")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_text("\n".join(lines) + "\n")
    assert (
        main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4))
        == 1
    )
    assert [(entry["rows"], entry["failed"]) for entry in ledger(out)] == [(201, 1), (201, 1)]


def test_a_bad_line_appended_to_a_watched_manifest_is_recorded_and_the_watch_goes_on(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The training code writes one broken line, then goes on: the line is an error line, the next checkpoints run
    (was: exit 2, the whole sweep stopped). The lines are appended once step-1's ledger line is written: the watch is
    under way, whatever the machine's speed."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 2))
    manifest = run / "checkpoints.jsonl"
    manifest.write_text(manifest_line("step-1.tar.gz", 1))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 3), tmp_path / "out"

    def append_later() -> None:
        try:
            wait_until(lambda: ledger_lines(out) >= 1, "the sweep finished step-1")
        finally:  # written even so: the watch ends, and the assertions say what went wrong
            with manifest.open("a") as handle:
                handle.write("{broken\n")
                handle.write(manifest_line("step-2.tar.gz", 2, final=True))

    writer = threading.Thread(target=append_later)
    writer.start()
    try:
        argv = [
            *sweep_args(engine, lora_dir, inp, out, concurrency=4),
            "--manifest",
            str(manifest),
            "--quiet",
            "--watch",
        ]
        assert main(argv) == 1
    finally:
        writer.join()
    entries = ledger(out)
    assert [entry.get("rows") for entry in entries if "error" not in entry] == [3, 3]
    (bad,) = [entry for entry in entries if "error" in entry]
    assert bad["error"]["type"] == "BatchInputError" and "line 2 is not JSON" in bad["error"]["message"]


# -- bounded waits -----------------------------------------------------------------------------------------------


@pytest.fixture
def writer_stop() -> Iterator[threading.Event]:
    stop = threading.Event()
    yield stop
    stop.set()


def test_a_growing_logs_folder_matched_by_the_pattern_does_not_hold_the_watch(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, writer_stop: threading.Event
) -> None:
    """``run/*`` matches a TensorBoard ``logs/`` folder that keeps growing: it holds no adapter file, so it is noted
    once and skipped; --idle-timeout ends the watch (was: held for as long as the writer ran)."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model))

    def keep_writing() -> None:
        number = 0
        while not writer_stop.wait(0.05):
            (run / "logs" / f"events.{number}").write_bytes(b"x" * 100)
            number += 1

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 3), tmp_path / "out"
    argv = [
        *sweep_args(engine, lora_dir, inp, out, concurrency=4),
        "--checkpoints",
        str(run / "*"),
        "--quiet",
        "--watch",
    ]
    started = time.monotonic()
    assert main([*argv, "--idle-timeout", "1"]) == 0
    assert time.monotonic() - started < 20  # the writer never stops; the watch did
    assert [os.path.basename(entry["checkpoint"]) for entry in ledger(out)] == ["step-1.tar.gz"]


def test_a_checkpoint_that_keeps_changing_is_recorded_after_the_checkpoint_timeout(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, writer_stop: threading.Event
) -> None:
    """A checkpoint rewritten every 0.1 s never settles: after --checkpoint-timeout it is CheckpointIncompleteError
    and the sweep goes on (was: waited on for as long as the writer ran)."""
    run = tmp_path / "run"
    run.mkdir()
    aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model))
    busy = run / "step-2.tar.gz"
    write_adapter_archive(str(busy), engine.model, rank=2)

    def keep_touching() -> None:
        while not writer_stop.wait(0.1):
            os.utime(busy)

    threading.Thread(target=keep_touching, daemon=True).start()
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 3), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4)
    started = time.monotonic()
    assert main([*argv, "--settle", "0.5", "--checkpoint-timeout", "1.5"]) == 1
    assert time.monotonic() - started < 20
    got = by_name(ledger(out))
    assert got["step-1.tar.gz"]["rows"] == 3
    assert got["step-2.tar.gz"]["error"]["type"] == "CheckpointIncompleteError"
    assert "kept changing" in got["step-2.tar.gz"]["error"]["message"]


# -- symlinks ----------------------------------------------------------------------------------------------------


def test_a_symlink_loop_counts_each_checkpoint_once(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """``run/a -> .`` and ``run/b -> .`` under ``run/**/step-*.tar.gz``: two checkpoints, two ledger lines, two
    unloads (was: 82 lines for one loop; the glob never ended for two)."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 2))
    os.symlink(".", run / "a")
    os.symlink(".", run / "b")
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 4), tmp_path / "out"
    pattern = str(run / "**" / "step-*.tar.gz")
    assert main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", pattern, "--quiet", concurrency=4)) == 0
    entries = ledger(out)
    assert sorted(entry["checkpoint"] for entry in entries) == [str(run / "step-1.tar.gz"), str(run / "step-2.tar.gz")]
    assert sum(entry["rows"] for entry in entries) == 8 and engine.calls(UNLOAD) == 2


def test_two_real_paths_with_the_same_bytes_share_one_adapter(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A copy is its own checkpoint (its own line) with the same adapter: the second finds its rows done."""
    run = tmp_path / "run"
    run.mkdir()
    first = aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model))
    (run / "step-2.tar.gz").write_bytes(Path(first).read_bytes())
    aged(str(run / "step-2.tar.gz"))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 6), tmp_path / "out"
    assert (
        main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4))
        == 0
    )
    entries = ledger(out)
    assert len(entries) == 2 and entries[0]["adapter"] == entries[1]["adapter"]
    assert engine.calls(COMPLETIONS) <= 6 + 2  # the rows once (plus a warm-up each at most)


# -- two runs, one resolver folder -------------------------------------------------------------------------------


def test_delete_retired_keeps_a_folder_another_run_holds(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A second run (here another client) samples the same checkpoint: the first sweep's --delete-retired keeps its
    folder and says so in the ledger; an unheld one is deleted and named (was: deleted under the other run)."""
    run = tmp_path / "run"
    run.mkdir()
    shared = aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model, rank=1))
    aged(write_adapter_archive(str(run / "step-2.tar.gz"), engine.model, rank=2))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 3), tmp_path / "out"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as other_run:
        used = other_run.publish(shared)
        argv = [
            *sweep_args(engine, lora_dir, inp, out, concurrency=4),
            "--checkpoints",
            str(run / "*.tar.gz"),
            "--quiet",
        ]
        assert main([*argv, "--delete-retired"]) == 0
        assert (lora_dir / used.name).is_dir()
        assert other_run.sample([5, 6], adapter=used).sequences
    notes = {os.path.basename(entry["checkpoint"]): entry["notes"] for entry in ledger(out)}
    assert "another run holds a lease" in notes["step-1.tar.gz"][0]
    assert notes["step-2.tar.gz"][0].startswith("deleted its adapter folder")
    assert sorted(p.name for p in lora_dir.iterdir()) == [used.name]


def test_delete_retired_keeps_a_folder_a_later_same_content_checkpoint_uses(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Three copies of one checkpoint share one adapter: the first ones keep its folder (and leave it loaded) for the
    later ones, which run the row the first failed again and meet its own error; the last deletes it (was:
    the first deleted it, and the later ones failed with "adapter_config.json is missing")."""
    run = tmp_path / "run"
    run.mkdir()
    first = aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model))
    for step in (2, 3):
        (run / f"step-{step}.tar.gz").write_bytes(Path(first).read_bytes())
        aged(str(run / f"step-{step}.tar.gz"))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 6), tmp_path / "out"
    engine.inject_prompt_fault("nan", marker=9)  # the line p4's answer is unreadable in every checkpoint
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4)
    assert main([*argv, "--delete-retired", "--window", "3", "--prompts-per-request", "1"]) == 1
    entries = ledger(out)
    assert len(entries) == 3 and len({entry["adapter"] for entry in entries}) == 1
    assert sorted("deleted its adapter folder" in entry["notes"][0] for entry in entries) == [False, False, True]
    failed = [record for record in lines_of(out / entries[0]["output"]) if "error" in record]
    assert failed and all(record["error"]["type"] == "EngineProtocolError" for record in failed)
    assert not [name for name in os.listdir(lora_dir) if not name.startswith(".")]


def test_two_sweeps_of_one_run_with_delete_retired_lose_nothing(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The issue's two sweeps at once (one resolver folder, --delete-retired, two output folders): every row of
    both is answered (was: the second lost 304 rows and wrote 48 error rows, exit 1)."""
    run = tmp_path / "run"
    make_run(run, engine.model, tuple(range(1, 7)))
    inp = write_prompts(tmp_path / "prompts.jsonl", 30)
    results: Dict[str, int] = {}

    def sweep_into(name: str) -> None:
        out = tmp_path / name
        argv = [
            *sweep_args(engine, lora_dir, inp, out, concurrency=4),
            "--checkpoints",
            str(run / "*.tar.gz"),
            "--quiet",
        ]
        results[name] = main([*argv, "--delete-retired"])

    threads = [threading.Thread(target=sweep_into, args=(name,)) for name in ("out-a", "out-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {"out-a": 0, "out-b": 0}
    for name in ("out-a", "out-b"):
        assert [(entry["rows"], entry["failed"]) for entry in ledger(tmp_path / name)] == [(30, 0)] * 6


# -- content that changes after it was evaluated -----------------------------------------------------------------


def _one_checkpoint_sweep(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> Tuple[str, List[str], Path]:
    """A run folder holding step-1 (rank 1, settled), four prompts: the checkpoint, the sweep's argv, its output."""
    run = tmp_path / "run"
    run.mkdir()
    checkpoint = aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model, rank=1))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 4), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4)
    return checkpoint, argv, out


def test_a_checkpoint_overwritten_after_the_sweep_is_evaluated_again_and_named(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Re-run after step-1 was overwritten with other weights: a new line under the new content name, ``replaces``
    naming the old adapter, and a note (was: never re-evaluated, no word)."""
    checkpoint, argv, out = _one_checkpoint_sweep(engine, lora_dir, tmp_path)
    assert main(argv) == 0
    old = ledger(out)[0]["adapter"]
    assert main(argv) == 0 and len(ledger(out)) == 1  # unchanged: nothing again
    aged(write_adapter_archive(checkpoint, engine.model, rank=5), seconds=30)
    assert main(argv) == 0
    _, second = ledger(out)
    assert second["replaces"] == old and second["adapter"] != old and second["rows"] == 4
    assert "content changed since it was evaluated as " + old in second["notes"][0]
    assert main(argv) == 0 and len(ledger(out)) == 2


def test_a_checkpoint_back_to_its_first_content_is_not_evaluated_again_at_every_run(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Content A, then B, then A again (its bytes copied back): the third run evaluates it as A once; a fourth finds
    nothing changed (was: the ledger's rewrite left B's line last, so every later run evaluated it again)."""
    checkpoint, argv, out = _one_checkpoint_sweep(engine, lora_dir, tmp_path)
    first = Path(checkpoint).read_bytes()
    assert main(argv) == 0
    aged(write_adapter_archive(checkpoint, engine.model, rank=5), seconds=50)
    assert main(argv) == 0
    Path(checkpoint).write_bytes(first)
    aged(checkpoint, seconds=40)
    assert main(argv) == 0
    adapters = [entry["adapter"] for entry in ledger(out)]
    assert len(adapters) == 2 and adapters[-1] == default_adapter_name(checkpoint)
    unloads = engine.calls(UNLOAD)
    assert main(argv) == 0
    assert engine.calls(UNLOAD) == unloads and [entry["adapter"] for entry in ledger(out)] == adapters


def test_a_touched_but_unchanged_checkpoint_is_not_evaluated_again(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A checkpoint copied over with the same bytes (a new mtime): hashed again, same adapter, nothing sent."""
    checkpoint, argv, out = _one_checkpoint_sweep(engine, lora_dir, tmp_path)
    assert main(argv) == 0
    sent = engine.calls(COMPLETIONS)
    aged(checkpoint, seconds=30)
    assert main(argv) == 0
    assert engine.calls(COMPLETIONS) == sent
    (entry,) = ledger(out)
    assert "replaces" not in entry


# -- messages and leftovers --------------------------------------------------------------------------------------


def test_a_full_disk_names_output_dir_and_stops_with_exit_2(
    engine: FakeEngine,
    lora_dir: Path,
    tmp_path: Path,
    no_waits: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ENOSPC while writing rows: the message says --output-dir, the sweep stops (exit 2) instead of failing every
    later checkpoint (was: "--output", exit 1 after every checkpoint failed); the next run resumes."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 2, 3))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 10), tmp_path / "out"
    real_write = _job.write_record
    written = [0]

    def write_until_full(stream: Any, record: Dict[str, Any]) -> None:
        written[0] += 1
        if written[0] > 15:
            raise output_error(stream.name, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        real_write(stream, record)

    monkeypatch.setattr(_job, "write_record", write_until_full)
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--output-dir " + str(out) in err and "No space left on device" in err
    assert "--output " not in err
    assert len(ledger(out)) <= 1
    monkeypatch.setattr(_job, "write_record", real_write)
    assert main(argv) == 0
    assert [entry["rows"] for entry in ledger(out)] == [10, 10, 10]


def test_a_wrong_base_model_checkpoint_leaves_no_folder(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Its folder is removed from --lora-base-dir again, as ``sample`` does (was: left there)."""
    run = tmp_path / "run"
    run.mkdir()
    aged(write_adapter_archive(str(run / "step-1.tar.gz"), "another/model"))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "out"
    assert (
        main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet", concurrency=4))
        == 1
    )
    (entry,) = ledger(out)
    assert entry["error"]["type"] == "AdapterConfigError" and "removed again" in entry["error"]["message"]
    assert list(lora_dir.iterdir()) == []


def test_control_characters_in_checkpoint_names_are_escaped_when_printed(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name with a newline and a terminal escape prints as ``\\n`` and ``\\x1b``, never raw."""
    run = tmp_path / "run"
    run.mkdir()
    aged(write_adapter_archive(str(run / "step-1\n\x1b[2Jfake.tar.gz"), engine.model))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "out"
    assert main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), concurrency=4)) == 0
    captured = capsys.readouterr()
    for text in (captured.out, captured.err):
        assert "\x1b" not in text and "step-1\n" not in text
    assert "step-1\\n\\x1b[2Jfake.tar.gz" in captured.err and "step-1\\n\\x1b[2Jfake.tar.gz" in captured.out


def test_manifest_paths_outside_its_folder_need_the_flag(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """An absolute path elsewhere and a ``..`` path are error lines naming --allow-outside-paths; with the flag they
    run (was: any path on disk copied into the shared folder)."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    aged(write_adapter_archive(str(run / "step-1.tar.gz"), engine.model, rank=1))
    outside = aged(write_adapter_archive(str(elsewhere / "step-2.tar.gz"), engine.model, rank=2))
    aged(write_adapter_archive(str(elsewhere / "step-3.tar.gz"), engine.model, rank=3))
    manifest = run / "checkpoints.jsonl"
    manifest.write_text(
        manifest_line("step-1.tar.gz", 1) + manifest_line(outside, 2) + manifest_line("../elsewhere/step-3.tar.gz", 3)
    )
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", concurrency=4)
    assert main(argv) == 1
    entries = ledger(out)
    assert sorted(str(entry.get("rows")) for entry in entries) == ["2", "None", "None"]
    assert all("--allow-outside-paths" in entry["error"]["message"] for entry in entries if "error" in entry)
    assert len(list(lora_dir.iterdir())) <= 1
    assert main([*argv, "--allow-outside-paths"]) == 0
    assert sorted(entry["step"] for entry in ledger(out)) == [1, 2, 3]


def test_a_folder_checkpoint_publishes_only_its_adapter_files(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A manifest names a checkpoint folder that also holds private files and an optimizer state: only the config
    and weights reach the shared resolver folder."""
    run = tmp_path / "run"
    folder = Path(write_adapter(run / "step-1", engine.model))
    (folder / "wandb-api-key.txt").write_text("not for sharing")
    (folder / "optimizer").mkdir()
    (folder / "optimizer" / "state.pt").write_bytes(b"x" * 100)
    for path in folder.rglob("*"):
        aged(str(path))
    manifest = run / "checkpoints.jsonl"
    manifest.write_text(manifest_line("step-1", 1))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "out"
    argv = [
        *sweep_args(engine, lora_dir, inp, out, concurrency=4),
        "--manifest",
        str(manifest),
        "--quiet",
        "--keep-loaded",
    ]
    assert main(argv) == 0
    (published,) = list(lora_dir.iterdir())
    assert sorted(p.name for p in published.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert published.name == default_adapter_name(str(folder))


def test_a_lease_held_elsewhere_is_released_when_that_process_dies(lora_dir: Path) -> None:
    """The lease of a run is released with its process (here: a lease taken and released in-process stands in)."""
    (lora_dir / "x").mkdir()
    lease = hold(lora_dir, "x")
    lease.release()
    assert not (lora_dir / ".leases").exists()
