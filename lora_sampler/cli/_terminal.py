"""What the ``sample`` command shows and hears on the terminal besides the progress bar (``ProgressBar``): what
makes two failed lines' errors the same, log lines above the bar, Ctrl-C. No batch logic here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence

from lora_sampler._client.progress import ProgressBar, say_above_bars
from lora_sampler.batch._job import DEFAULT_DRAIN_SECONDS

#: The format of lora_sampler's log lines on stderr.
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
_NUMBERS = re.compile(r"\d+")


#: ``BatchJob``'s ``on_event``: ``(kind, line, record)``.
RowEvent = Callable[[str, Any, Optional[Dict[str, Any]]], None]


def counting_rows(bar: ProgressBar, message_of: Callable[[Dict[str, Any]], str]) -> RowEvent:
    """The ``on_event`` hook that counts a job's rows on ``bar``, a failed one with its error (``message_of``)."""

    def on_event(kind: str, line: Any, record: Optional[Dict[str, Any]]) -> None:
        error = message_of(record) if kind == "failed" and record is not None else ""
        bar.count_row(kind, error, error_key(error, record) if record is not None and error else "")

    return on_event


def error_key(message: str, record: Dict[str, Any]) -> str:
    """What makes two failed lines' errors the same: their message without the line's id and numbers."""
    if record.get("id") is not None:
        message = message.replace(f"(id {record['id']!r})", "(id)", 1)
    if record.get("custom_id") is not None:
        message = message.replace(f"custom_id {record['custom_id']!r}", "custom_id", 1)
    return _NUMBERS.sub("N", message)


def aligned(rows: Sequence[Sequence[str]], *, numbers: bool = False) -> List[str]:
    """The rows as lines of columns two spaces apart, each as wide as its widest cell (a row may stop early);
    ``numbers``: every column but the first is right-aligned."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if numbers and i else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells))
    return lines


class _Stderr(logging.Handler):
    """lora_sampler's log lines on stderr, above the progress bar while one is drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say_above_bars(self.format(record))
        except Exception:  # as logging's own handlers: a line that cannot be written is reported, never raised
            self.handleError(record)


@contextlib.contextmanager
def logs_to_stderr(level: str) -> Iterator[None]:
    """Print lora_sampler's log lines of ``level`` and above on stderr for the block (above the progress bar while
    one is drawn)."""
    package = logging.getLogger("lora_sampler")
    previous, handler = package.level, _Stderr()
    package.setLevel(level)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)


def say_from_signal_handler(message: str) -> None:
    """Print a line on stderr from a signal handler.

    The handler runs in the main thread between two of its steps, which may be inside a ``print`` to stderr: its
    buffer is then locked by the very frame the handler interrupted, and another ``print`` raises "reentrant call".
    Then the line goes straight to stderr's file descriptor, on a line of its own.
    """
    try:
        print(message, file=sys.stderr)
    except RuntimeError:  # reentrant call: the interrupted frame holds stderr's buffer
        # No descriptor (a captured stderr): the line is lost, the exit status still says it.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.write(sys.stderr.fileno(), f"\n{message}\n".encode("utf-8", "replace"))


@dataclass
class Interrupts:
    """How many times Ctrl-C was pressed during the job."""

    count: int = 0


class Stoppable(Protocol):
    """A ``BatchJob`` or a ``Sweep``: what Ctrl-C stops."""

    def stop(self, grace: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Take no new work; abandon what is in flight after ``grace`` seconds."""
        ...


@contextlib.contextmanager
def interrupts_stop(job: Stoppable) -> Iterator[Interrupts]:
    """First Ctrl-C: take no new lines and give in-flight requests a few seconds; the second: stop now."""
    state = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield state  # signal handlers can only be set in the main thread
        return

    def handler(signum: int, frame: Optional[FrameType]) -> None:
        state.count += 1
        idle = getattr(job, "idle", False)  # a sweep waiting for a checkpoint has nothing in flight
        job.stop(grace=0.0 if idle or state.count > 1 else DEFAULT_DRAIN_SECONDS)
        if state.count == 1:
            say_from_signal_handler(
                "lora-sampler: interrupted while waiting; nothing was in flight, stopping now"
                if idle
                else "lora-sampler: interrupted; finishing the requests in flight (Ctrl-C again to stop now)"
            )

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)
