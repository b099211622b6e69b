"""``_files``: the one ``flock`` (``try_flock``) that leases, an output's one-writer lock and a sweep's folder lock
share (held, held by another process: a refusal or a wait, or no locks here: go on unlocked and say so), and the mode
of a file ``replacing`` writes."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lora_sampler import _files
from lora_sampler._adapters.lease import hold, leased, remove_if_unleased
from lora_sampler.batch import one_writer
from lora_sampler.batch._ledger import Ledger
from lora_sampler.errors import LoraSamplerError

HOLD_IN_CHILD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def no_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem whose ``flock`` fails (ENOLCK), as some NFS and FUSE mounts do."""

    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)


def test_try_flock_says_held_taken_or_no_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """True when taken, False while another process holds it, None where flock fails."""
    path = tmp_path / "f"
    path.write_text("")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_IN_CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert _files.try_flock(fd, str(path)) is False
            assert _files.try_flock(fd, str(path), shared=True) is False
        finally:
            os.close(fd)
    finally:
        child.communicate("")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _files.try_flock(fd, str(path)) is True
    finally:
        os.close(fd)


def test_without_locks_each_user_goes_on_unlocked_and_says_what_that_leaves(
    tmp_path: Path, no_locks: None, caplog: Any
) -> None:
    """A lease holds nothing, a clean-up deletes nothing, an output and a sweep folder are written unlocked: each
    warning names the file, the error and what is left to the user."""
    caplog.set_level(logging.WARNING)
    (tmp_path / "loras" / "a").mkdir(parents=True)
    lease = hold(tmp_path / "loras", "a")
    assert not lease.held and "other runs' clean-ups cannot see that a is in use" in caplog.text
    assert "No locks available" in caplog.text
    assert remove_if_unleased(tmp_path / "loras", "a") is False and (tmp_path / "loras" / "a").is_dir()
    assert "the folder of a is kept" in caplog.text
    assert leased(tmp_path / "loras", "a") is None
    lease.release()
    with one_writer(str(tmp_path / "out.jsonl")):
        assert f"make sure no other run writes {tmp_path / 'out.jsonl'} meanwhile" in caplog.text
    with Ledger(str(tmp_path / "sweep")) as ledger:
        ledger.append({"checkpoint": "c", "path": "c", "adapter": "a"})
    assert "one sweep per folder is up to you" in caplog.text


def test_a_held_output_and_a_held_sweep_folder_are_refused(tmp_path: Path) -> None:
    """The second writer of one output, and a second sweep into one folder, are refused naming the fix."""
    with one_writer(str(tmp_path / "out.jsonl")):
        with pytest.raises(LoraSamplerError, match=r"another run is writing .*pass another --output"):
            with one_writer(str(tmp_path / "out.jsonl")):
                pass
    with Ledger(str(tmp_path / "sweep")):
        with pytest.raises(LoraSamplerError, match=r"another sweep is writing to .*another --output-dir"):
            Ledger(str(tmp_path / "sweep"))


def test_replacing_gives_a_new_file_opens_mode_and_keeps_an_old_files(tmp_path: Path) -> None:
    """A file made by ``replacing`` has the mode ``open`` gives a new file (0666 less the umask: others in a shared
    folder can read it; it was mkstemp's 0600), and a replaced file keeps its own mode."""
    previous = os.umask(0o022)
    try:
        with _files.replacing(str(tmp_path / "new.jsonl")) as out:
            out.write(b"{}\n")
        kept = tmp_path / "kept.jsonl"
        kept.write_text("old\n")
        kept.chmod(0o640)
        with _files.replacing(str(kept), durable=False) as out:
            out.write(b"new\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o644
    assert kept.stat().st_mode & 0o777 == 0o640 and kept.read_text() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["kept.jsonl", "new.jsonl"]  # no temporary left
