"""Ctrl-C in the command line's jobs: the first asks the job to stop and says so, even mid-``print``."""

from __future__ import annotations

import io
import os
import signal
import sys
from typing import Any, List

import pytest

from lora_sampler.batch._job import DEFAULT_DRAIN_SECONDS
from lora_sampler.cli._terminal import interrupts_stop


class _Job:
    """What ``interrupts_stop`` stops: records the grace it was given."""

    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.graces: List[float] = []

    def stop(self, grace: float = 5.0) -> None:
        self.graces.append(grace)


class _InterruptedWhileWriting(io.RawIOBase):
    """A stderr whose first write is interrupted by Ctrl-C: the handler runs while the buffer's lock is held."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = bytearray()
        self.armed = True

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data: Any) -> int:
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the buffered writer's write
        self.written += bytes(data)
        return len(data)


@pytest.mark.parametrize("idle", [True, False], ids=["idle", "in-flight"])
def test_ctrl_c_during_a_print_to_stderr_stops_the_job_and_says_so(idle: bool, monkeypatch: Any) -> None:
    """Measured on main e2255b3: "RuntimeError: reentrant call inside <_io.BufferedWriter name='<stderr>'>", a
    traceback and exit 1 instead of 130 (a sweep's state line was being printed when Ctrl-C came)."""
    read_end, write_end = os.pipe()
    try:
        raw = _InterruptedWhileWriting(write_end)
        stderr = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=True)
        monkeypatch.setattr(sys, "stderr", stderr)
        job = _Job(idle)
        with interrupts_stop(job) as state:
            print("lora-sampler: waiting for a new checkpoint", file=sys.stderr)  # interrupted mid-write
        stderr.flush()
        os.close(write_end)
        write_end = -1
        direct = os.read(read_end, 65536).decode()
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert state.count == 1 and job.graces == [0.0 if idle else DEFAULT_DRAIN_SECONDS]
    said = "nothing was in flight" if idle else "finishing the requests in flight"
    assert said in direct + raw.written.decode()
    assert "waiting for a new checkpoint" in raw.written.decode()  # the interrupted line is whole


def test_ctrl_c_handler_is_removed_after_the_job(monkeypatch: Any) -> None:
    before = signal.getsignal(signal.SIGINT)
    with interrupts_stop(_Job(False)):
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
