"""A sweep's sources and ledger without an engine: natural order, the manifest, the settle/complete probe, resume."""

from __future__ import annotations

import errno
import json
import os
import struct
import tarfile
import threading
from pathlib import Path
from typing import Any, List

import pytest
from _sweeps import aged

from lora_sampler.batch import _ledger as ledger_module
from lora_sampler.batch._ledger import LEDGER_NAME, Ledger, read_ledger
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.batch._sources import (
    CheckpointSource,
    Manifest,
    checkpoint_fingerprint,
    content_signature,
    expand_pattern,
    listing,
    natural_key,
    read_manifest,
    step_of,
)
from lora_sampler.errors import CheckpointIncompleteError, LoraSamplerError, OutputWriteError
from lora_sampler.testing import write_adapter, write_adapter_archive


def test_natural_key_orders_numbers_as_numbers() -> None:
    """step-200 sorts before step-1000, and digits inside names compare as numbers."""
    names = ["step-1000", "step-200", "step-20", "run2/step-3", "run10/step-1"]
    assert sorted(names, key=natural_key) == ["run2/step-3", "run10/step-1", "step-20", "step-200", "step-1000"]


def test_expand_pattern_takes_archives_and_folders_in_natural_order(tmp_path: Path) -> None:
    """A glob keeps archives and adapter folders, in natural order, and ignores other files."""
    for step in (1000, 200, 2000, 100):
        (tmp_path / f"step-{step}.tar.gz").write_bytes(b"x")
    (tmp_path / "step-300.tar.gz.partial").write_bytes(b"x")
    (tmp_path / "step-50").mkdir()
    (tmp_path / "step-50" / "adapter_model.safetensors").write_bytes(b"x")
    (tmp_path / "step-60").mkdir()  # no adapter file at all (yet): not a checkpoint
    found = expand_pattern(str(tmp_path / "step-*"))
    assert [os.path.basename(p) for p in found] == [
        "step-50",
        "step-100.tar.gz",
        "step-200.tar.gz",
        "step-1000.tar.gz",
        "step-2000.tar.gz",
    ]
    assert expand_pattern(str(tmp_path / "step-7.tar.gz")) == []  # not there yet: a watch waits for it


def test_a_listing_notes_a_match_without_adapter_files_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A glob's match that holds no adapter file (a logs folder) is left out of every listing and warned of once."""
    aged(write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base"))
    (tmp_path / "logs").mkdir()
    listed = listing(str(tmp_path / "*"), _settings(tmp_path / "elsewhere", watch=True))
    with caplog.at_level("WARNING", logger="lora_sampler.batch._sources"):
        assert [c.path for c in listed()] == [c.path for c in listed()] == [str(tmp_path / "step-1.tar.gz")]
    noted = [r.getMessage() for r in caplog.records if "holds no adapter file" in r.getMessage()]
    assert len(noted) == 1 and "logs" in noted[0] and "looked at again" in noted[0]


def test_step_of_reads_the_last_number_of_the_name() -> None:
    """The step is the last run of digits of the name, without the archive suffix."""
    assert step_of("/runs/r3/step-1200.tar.gz") == 1200
    assert step_of("/runs/r3/ckpt_000300/") == 300
    assert step_of("/runs/final.tar") is None


def test_read_manifest_skips_state_only_lines_and_resolves_relative_paths(tmp_path: Path) -> None:
    """Manifest lines: sampler_path or path, batch or step, final; state-only lines and a torn last line skipped."""
    manifest = tmp_path / "checkpoints.jsonl"
    lines = [
        {"name": "000100", "batch": 100, "state_path": "tinker://state/1"},
        {"name": "000100", "batch": 100, "sampler_path": "ckpts/step-100.tar.gz", "loss": 1.5},
        {"name": "000200", "step": 200, "path": "/abs/step-200"},
        {"name": "final", "batch": 300, "sampler_path": "ckpts/step-300.tar.gz", "final": True},
    ]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"name": "000400", "sampler')
    got = read_manifest(str(manifest))
    assert [(c.path, c.step, c.final) for c in got] == [
        (str(tmp_path / "ckpts" / "step-100.tar.gz"), 100, False),
        ("/abs/step-200", 200, False),
        (str(tmp_path / "ckpts" / "step-300.tar.gz"), 300, True),
    ]


def test_read_manifest_keeps_a_bad_line_in_the_middle_as_a_problem(tmp_path: Path) -> None:
    """A complete line that is not JSON is an entry with a problem naming the line (recorded, the rest goes on)."""
    manifest = tmp_path / "checkpoints.jsonl"
    manifest.write_text('{"sampler_path": "a.tar"}\nnot json\n{"sampler_path": "b.tar"}\n')
    got = read_manifest(str(manifest))
    assert [os.path.basename(c.path) for c in got] == ["a.tar", "checkpoints.jsonl#line2", "b.tar"]
    assert got[1].problem is not None and "line 2 is not JSON" in str(got[1].problem)
    assert got[0].problem is None and got[2].problem is None


@pytest.mark.parametrize("bad", ["a\u0000b.tar", "\ud800.tar"])
def test_read_manifest_keeps_a_path_no_file_can_have_as_a_problem(tmp_path: Path, bad: str) -> None:
    """A sampler path with a NUL byte or a lone surrogate is that line's problem, the rest goes on (was: ValueError
    out of the listing, which ended the sweep, a watch included, naming no line)."""
    manifest = tmp_path / "checkpoints.jsonl"
    lines = [{"sampler_path": "a.tar"}, {"sampler_path": bad}, {"sampler_path": "b.tar"}]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = read_manifest(str(manifest))
    assert [os.path.basename(c.path) for c in got] == ["a.tar", "checkpoints.jsonl#line2", "b.tar"]
    assert "line 2 has a sampler_path no file can have" in str(got[1].problem)


def test_checkpoint_fingerprint_tells_a_truncated_archive(tmp_path: Path) -> None:
    """An archive cut in half does not read to its end; the whole one does."""
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")
    data = Path(archive).read_bytes()
    half = tmp_path / "step-2.tar.gz"
    half.write_bytes(data[: len(data) // 2])
    assert checkpoint_fingerprint(archive)[1] is None
    assert "does not read to its end" in str(checkpoint_fingerprint(str(half))[1])


def test_checkpoint_fingerprint_tells_an_archive_corrupted_without_changing_its_length(tmp_path: Path) -> None:
    """A ``.tar.gz`` whose gzip CRC was damaged (same length, every member still readable) does not read to its end:
    the probe reads the compressed stream to its very end, as publishing does, so the CRC is checked (was: tarfile
    stopped at the end-of-archive marker and never reached the CRC, so the probe called it complete and publishing
    then refused it)."""
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")
    data = bytearray(Path(archive).read_bytes())
    data[-8] ^= 0xFF  # the gzip trailer's CRC32
    damaged = tmp_path / "step-2.tar.gz"
    damaged.write_bytes(bytes(data))
    assert len(data) == os.path.getsize(archive)
    assert "does not read to its end" in str(checkpoint_fingerprint(str(damaged))[1])


def test_checkpoint_fingerprint_signs_the_file_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive replaced right after the probe first looks at it is judged and signed as one file: the signature
    returned is that of the file whose bytes were read (was: the probe signed the old file from ``stat``, then opened
    the path again and read the new one, so a truncated replacement's problem came with the old file's signature)."""
    path = tmp_path / "step-1.tar.gz"
    write_adapter_archive(str(path), "tiny-base")
    whole = content_signature(str(path))
    half = tmp_path / "half"
    half.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    replaced: List[bool] = []
    real_stat, real_fstat = os.stat, os.fstat

    def replace_after(result: Any) -> Any:
        if not replaced:
            replaced.append(True)
            os.replace(half, path)  # a new inode at the path, truncated
        return result

    monkeypatch.setattr(
        os, "stat", lambda *a, **k: replace_after(real_stat(*a, **k)) if a[0] == str(path) else real_stat(*a, **k)
    )
    monkeypatch.setattr(os, "fstat", lambda fd: replace_after(real_fstat(fd)))
    _, problem, signature = checkpoint_fingerprint(str(path))
    monkeypatch.undo()
    assert replaced
    truncated = content_signature(str(path))
    assert (problem is None and signature == whole) or (problem is not None and signature == truncated), (
        problem,
        signature,
        whole,
        truncated,
    )


def test_checkpoint_fingerprint_tells_a_folder_still_being_written(tmp_path: Path) -> None:
    """A folder whose safetensors file is shorter than its header says is incomplete; whole, it is complete."""
    folder = write_adapter(tmp_path / "step-5", "tiny-base")
    weights = next(p for p in Path(folder).iterdir() if p.suffix == ".safetensors")
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-8])
    assert "its header declares" in str(checkpoint_fingerprint(folder)[1])
    weights.write_bytes(whole)
    assert checkpoint_fingerprint(folder)[1] is None


@pytest.mark.parametrize(
    "header", [[1], "text", {"w": 5}, {"w": {"data_offsets": [0]}}, {"w": {"data_offsets": [0, "9"]}}]
)
def test_a_safetensors_header_that_is_no_object_of_tensors_is_the_folders_problem(tmp_path: Path, header: Any) -> None:
    """A weights file whose JSON header is not an object of tensors with two offsets is an unreadable header, the
    folder's problem (a sweep records it and goes on; was: TypeError, AttributeError or IndexError out of the probe,
    which ended the whole sweep with exit 2 naming no checkpoint)."""
    folder = write_adapter(tmp_path / "step-5", "tiny-base")
    raw = json.dumps(header).encode()
    (Path(folder) / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    assert "adapter_model.safetensors: unreadable header" in str(checkpoint_fingerprint(folder)[1])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_matched_as_a_checkpoint_is_never_read(tmp_path: Path) -> None:
    """A pipe named like an archive is a problem found from ``stat`` (was: the probe opened it and waited for a
    writer for ever); without a watch the source gives it up as incomplete. Run in a thread, so a regression fails
    after 10 s instead of holding the suite."""
    pipe = tmp_path / "step-1.tar.gz"
    os.mkfifo(pipe)
    aged(str(pipe))
    settings = _settings(tmp_path, settle=0.1)
    source = CheckpointSource(listing(str(tmp_path / "*.tar.gz"), settings), settings)
    taken: List[Any] = []
    worker = threading.Thread(target=lambda: taken.append(source.poll()), daemon=True)
    worker.start()
    worker.join(10)
    assert taken and taken[0] is not None and "not a regular file" in str(taken[0].problem)
    assert "not a regular file" in str(checkpoint_fingerprint(str(pipe))[1])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_named_pipe_in_an_adapter_folder_is_never_read(tmp_path: Path, name: str) -> None:
    """A folder whose config or weights file is a pipe is the folder's problem, found from ``stat`` (was: the probe
    opened the pipe and waited for a writer for ever), and its signature is the one ``content_signature`` gives. Run
    in a thread, so a regression fails after 10 s instead of holding the suite."""
    folder = write_adapter(tmp_path / "step-5", "tiny-base")
    os.remove(os.path.join(folder, name))
    os.mkfifo(os.path.join(folder, name))
    looked: List[Any] = []
    worker = threading.Thread(target=lambda: looked.append(checkpoint_fingerprint(folder)), daemon=True)
    worker.start()
    worker.join(10)
    assert looked and f"its {name} is not a regular file" in str(looked[0][1])
    assert looked[0][2] == content_signature(folder)


def test_a_safetensors_header_longer_than_the_formats_limit_is_never_read(tmp_path: Path) -> None:
    """A weights file whose first 8 bytes declare a header over safetensors' own limit (100,000,000 bytes) is the
    folder's problem, named as such, with the header left unread (was: the probe read that many bytes into memory,
    as many as the file holds, and then called the header unreadable)."""
    folder = write_adapter(tmp_path / "step-5", "tiny-base")
    weights = Path(folder) / "adapter_model.safetensors"
    with open(weights, "wb") as handle:
        handle.write(struct.pack("<Q", 100_000_001))
        handle.truncate(8 + 100_000_001 + 16)  # sparse: no disk is used for the bytes the header claims
    problem = str(checkpoint_fingerprint(folder)[1])
    assert "adapter_model.safetensors: its header declares 100000001 bytes" in problem
    assert "100000000" in problem


def _settings(folder: Path, **fields: Any) -> SweepSettings:
    """A sweep's settings (its output folder unused here) with the source's ``fields``."""
    return SweepSettings(output_dir=str(folder / "out"), **fields)


def test_source_waits_for_a_changing_checkpoint_then_takes_it(tmp_path: Path) -> None:
    """A fresh archive is taken only after it stayed unchanged for the settle time.

    The test drives the source's clock: a settle of 30 s (far above how long the first poll takes on a loaded
    machine, so the archive's own modification time never settles it first) passes at once, with no sleep."""
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")
    now = [1000.0]
    settings = _settings(tmp_path, settle=30.0)
    source = CheckpointSource(listing(str(tmp_path / "step-*.tar.gz"), settings), settings, clock=lambda: now[0])
    assert source.poll() is None  # seen for the first time, modified just now
    now[0] += 30.05  # unchanged for longer than the settle time, as the source watched it
    taken = source.poll()
    assert taken is not None and taken.problem is None and taken.path == archive
    assert source.poll() is None and source.ended


def test_a_folder_settles_on_its_adapter_files_whatever_else_it_holds(tmp_path: Path) -> None:
    """A checkpoint folder whose adapter files were written a while ago is taken at once, though the training run
    still writes its log beside them (publishing reads the adapter files only; the whole folder made it wait), and
    the signature it is handed out with is the one ``content_signature`` gives (no second look)."""
    folder = write_adapter(tmp_path / "step-1", "tiny-base")
    for name in os.listdir(folder):
        aged(os.path.join(folder, name))
    (Path(folder) / "trainer_log.txt").write_text("step 1\n")  # written just now, and again at each step
    now = [1000.0]
    settings = _settings(tmp_path, settle=30.0)
    source = CheckpointSource(listing(str(tmp_path / "step-*"), settings), settings, clock=lambda: now[0])
    taken = source.poll()
    assert taken is not None and taken.problem is None and taken.path == folder
    assert taken.signature is not None and taken.signature == content_signature(folder)


def test_source_without_watch_gives_up_on_an_incomplete_archive(tmp_path: Path) -> None:
    """Without a watch, a settled archive that does not read to its end comes out as unusable, once."""
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")
    data = Path(archive).read_bytes()
    Path(archive).write_bytes(data[: len(data) // 2])
    aged(archive)
    settings = _settings(tmp_path, settle=0.1)
    source = CheckpointSource(listing(str(tmp_path / "*.tar.gz"), settings), settings)
    gave_up = source.poll()
    assert gave_up is not None and "incomplete" in str(gave_up.problem)
    assert source.poll() is None and source.ended


def test_source_skips_checkpoints_done_before(tmp_path: Path) -> None:
    """Checkpoints in the ledger are not handed out again."""
    done = aged(write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base"))
    new = aged(write_adapter_archive(str(tmp_path / "step-2.tar.gz"), "tiny-base", rank=2))
    settings = _settings(tmp_path, settle=0.1)
    source = CheckpointSource(listing([str(tmp_path / "*.tar.gz")], settings), settings, skip={done: {}})
    taken = source.poll()
    assert taken is not None and taken.problem is None and taken.path == new


def test_source_watch_ends_once_the_final_checkpoint_is_done(tmp_path: Path) -> None:
    """A watch on a manifest ends as soon as its final checkpoint finished, long before the idle timeout."""
    archive = aged(write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base"))
    manifest = tmp_path / "checkpoints.jsonl"
    manifest.write_text(json.dumps({"sampler_path": archive, "batch": 1, "final": True}) + "\n")
    settings = _settings(tmp_path, watch=True, settle=0.1, idle_timeout=3600)
    source = CheckpointSource(listing(Manifest(str(manifest)), settings), settings)
    taken = source.poll()
    assert taken is not None and taken.problem is None and taken.final
    assert source.poll() is None and not source.ended  # still watching while it runs
    source.finished(archive, {})
    assert source.poll() is None and source.ended


def _lines(path: Path) -> List[str]:
    return path.read_text().splitlines()


def test_ledger_repairs_a_torn_line_and_retries_failed_checkpoints(tmp_path: Path) -> None:
    """On open: finished lines kept, error lines dropped (they run again), a torn last line dropped."""
    path = tmp_path / LEDGER_NAME
    finished = {"checkpoint": "/r/step-1.tar.gz", "adapter": "a", "output": "a.jsonl", "rows": 3}
    failed = {"checkpoint": "/r/step-2.tar.gz", "error": {"type": "PublishError", "message": "bad"}}
    path.write_text(json.dumps(finished) + "\n" + json.dumps(failed) + "\n" + '{"checkpoint": "/r/st')
    with Ledger(str(tmp_path)) as ledger:
        assert list(ledger.finished) == ["/r/step-1.tar.gz"]
        ledger.append({"checkpoint": "/r/step-2.tar.gz", "adapter": "b", "output": "b.jsonl", "rows": 3})
    assert [entry["checkpoint"] for entry in read_ledger(str(path))] == ["/r/step-1.tar.gz", "/r/step-2.tar.gz"]
    assert all(line.endswith("}") for line in _lines(path))


def test_ledger_refuses_a_second_sweep_into_the_same_folder(tmp_path: Path) -> None:
    """While one sweep holds the folder, another one is refused with a message naming the folder."""
    with Ledger(str(tmp_path)):
        with pytest.raises(LoraSamplerError, match="another sweep is writing to"):
            Ledger(str(tmp_path))
    Ledger(str(tmp_path)).close()  # released once the first one closed


def test_tar_members_only_listed_are_enough_for_a_complete_archive(tmp_path: Path) -> None:
    """An uncompressed tar archive that reads to its end is complete."""
    folder = write_adapter(tmp_path / "adapter", "tiny-base")
    archive = tmp_path / "step-9.tar"
    with tarfile.open(archive, "w") as tar:
        for name in sorted(os.listdir(folder)):
            tar.add(os.path.join(folder, name), arcname=name)
    assert checkpoint_fingerprint(str(archive))[1] is None


def test_an_older_ledgers_line_without_path_is_done_under_a_symlinked_folder(tmp_path: Path) -> None:
    """A line of an older version names no ``path``: its ``checkpoint`` under a symlinked folder is keyed by its real
    path, as the listing keys it, so the checkpoint is not evaluated again."""
    real = tmp_path / "real"
    real.mkdir()
    aged(write_adapter_archive(str(real / "step-1.tar.gz"), "tiny-base"))
    (tmp_path / "run").symlink_to(real)
    named = str(tmp_path / "run" / "step-1.tar.gz")
    out = tmp_path / "out"
    out.mkdir()
    (out / LEDGER_NAME).write_text(json.dumps({"checkpoint": named, "adapter": "a", "output": "a.jsonl"}) + "\n")
    with Ledger(str(out)) as ledger:
        assert list(ledger.finished) == [str(real / "step-1.tar.gz")]
        settings = _settings(out, settle=0.0)
        source = CheckpointSource(listing(str(tmp_path / "run" / "*.tar.gz"), settings), settings, skip=ledger.finished)
        assert source.poll() is None and source.ended


def test_ledger_keeps_a_checkpoints_latest_evaluation_last(tmp_path: Path) -> None:
    """Content A, then B, then A again: the repeated (checkpoint, adapter) line goes and the new one is last, so a
    later run reads A as the latest evaluation (was: the rewrite kept A's place, the next run read B and evaluated
    the unchanged checkpoint again at every run)."""
    line = {"checkpoint": "/r/step-1.tar.gz", "output": "o.jsonl", "rows": 3}
    with Ledger(str(tmp_path)) as ledger:
        for adapter, signature in (("a", "s1"), ("b", "s2"), ("a", "s3")):
            ledger.append({**line, "adapter": adapter, "signature": signature})
        assert ledger.finished["/r/step-1.tar.gz"]["signature"] == "s3"
    assert [entry["adapter"] for entry in read_ledger(str(tmp_path / LEDGER_NAME))] == ["b", "a"]
    with Ledger(str(tmp_path)) as ledger:
        assert ledger.finished["/r/step-1.tar.gz"]["signature"] == "s3"


def test_ledger_keeps_this_runs_error_lines_when_a_repeat_goes(tmp_path: Path) -> None:
    """A touched checkpoint evaluated again in a run drops its older line, never a failure recorded earlier in the
    same run: the sweep's summary and exit status read it (was: dropped, the sweep exited 0 with a failure)."""
    done = {"checkpoint": "/r/step-1.tar.gz", "adapter": "a", "output": "a.jsonl", "rows": 3}
    failed = {"checkpoint": "/r/step-2.tar.gz", "error": {"type": "CheckpointIncompleteError", "message": "m"}}
    with Ledger(str(tmp_path)) as ledger:
        ledger.append(done)
    with Ledger(str(tmp_path)) as ledger:
        ledger.append(failed)
        ledger.append({**done, "signature": "touched"})
    entries = read_ledger(str(tmp_path / LEDGER_NAME))
    assert entries == [{**done, "signature": "touched"}, failed]  # the touched line in its older one's place


def test_a_watch_gives_up_on_a_checkpoint_still_written_once_the_final_one_is_done(tmp_path: Path) -> None:
    """The manifest's final checkpoint is done while an earlier one is still being written: that one comes out at
    once as incomplete, naming why, and the watch ends (no wait for its checkpoint timeout)."""
    growing = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")  # written just now
    final = aged(write_adapter_archive(str(tmp_path / "step-2.tar.gz"), "tiny-base", rank=2))
    manifest = tmp_path / "checkpoints.jsonl"
    lines = [{"sampler_path": growing, "batch": 1}, {"sampler_path": final, "batch": 2, "final": True}]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    now = [1000.0]
    settings = _settings(tmp_path, watch=True, settle=30.0, checkpoint_timeout=600.0)
    source = CheckpointSource(listing(Manifest(str(manifest)), settings), settings, clock=lambda: now[0])
    taken = source.poll()
    assert taken is not None and taken.path == final and taken.problem is None
    assert source.poll() is None and "to be complete" in source.waiting_for()
    source.finished(final, {"checkpoint": final, "adapter": "a"})
    gave_up = source.poll()
    assert gave_up is not None and gave_up.path == growing
    assert isinstance(gave_up.problem, CheckpointIncompleteError)
    assert "the run's final checkpoint is done" in str(gave_up.problem)
    assert source.poll() is None and source.ended and "final checkpoint" in source.end_reason


def test_ledger_that_cannot_be_rewritten_mid_run_is_an_output_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while a repeated line goes is the sweep's full-disk error (it says how to resume), not a bare
    OSError; the line is written, and the next opening drops its older twin."""
    done = {"checkpoint": "/r/step-1.tar.gz", "adapter": "a", "output": "a.jsonl", "rows": 3}
    with Ledger(str(tmp_path)) as ledger:
        ledger.append(done)
        with monkeypatch.context() as patched:
            patched.setattr(ledger_module, "_replace", _full_disk)
            with pytest.raises(OutputWriteError, match="cannot write"):
                ledger.append({**done, "signature": "touched"})
    with Ledger(str(tmp_path)) as ledger:
        assert ledger.finished["/r/step-1.tar.gz"]["signature"] == "touched"
    assert len(read_ledger(str(tmp_path / LEDGER_NAME))) == 1


def _full_disk(path: str, lines: List[bytes]) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")
