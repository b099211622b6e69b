"""What the ``sample`` command shows and hears on the terminal: the progress bar, log lines above it, Ctrl-C.

tqdm is imported only when stderr is a terminal (it is the optional ``cli`` extra). No batch logic here.
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol

from lora_sampler._client.outage import OutageEvent
from lora_sampler._client.progress import RetryCounter as RetryCounter  # the CLI's bar counts retries too
from lora_sampler.batch._job import DEFAULT_DRAIN_SECONDS

#: The format of lora_sampler's log lines on stderr.
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
#: Characters of an error message repeated in the count line at the end.
_SHORT_MESSAGE = 160
_NUMBERS = re.compile(r"\d+")


def progress_bar(total: Optional[int], quiet: bool) -> Any:
    """Return a tqdm bar on stderr when it is a terminal (and not ``quiet``, and tqdm is installed), else None."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="line", file=sys.stderr, dynamic_ncols=True)


class JobBar:
    """What the progress bar of a batch job shows: one step per line, the failures above it, retries, outages.

    Args:
        bar: The tqdm bar, or None (quiet, or not a terminal): then only failures are printed.
        retries: The counter fed by the client's retry hook.
        message_of: Reads a failed record's message.
    """

    def __init__(self, bar: Any, retries: RetryCounter, message_of: Callable[[Dict[str, Any]], str]):
        self.bar = bar
        self._retries, self._message_of = retries, message_of
        self._failed = 0
        #: Each distinct error's first message and how many lines failed with it, in the order first seen.
        self._errors: Dict[str, List[Any]] = {}

    def on_event(self, kind: str, line: object, record: Optional[Dict[str, Any]]) -> None:
        """Show one finished line (``BatchJob``'s ``on_event``, in the job's thread).

        A failure is printed the first time its error is seen; the same error on other lines is counted, and
        ``close`` prints the count once (29 lines failing during an outage make two lines, not 29).
        """
        if kind == "failed":
            self._failed += 1
            if record is not None:
                message = self._message_of(record)
                seen = self._errors.setdefault(error_key(message, record), [message, 0])
                seen[1] += 1
                if seen[1] == 1:
                    say(self.bar, f"lora-sampler: {message}")
        if self.bar is not None:
            self.bar.update(1)
            self._show()

    def on_outage(self, event: OutageEvent) -> None:
        """Show how long the engine has been away (from worker threads; tqdm holds its own lock)."""
        if self.bar is not None:
            self._show(
                **({"engine": f"away {event.waited:.0f}/{event.max_outage:g} s"} if event.kind != "back" else {})
            )
            self.bar.refresh()

    def close(self) -> None:
        """Say how many lines failed with each error seen more than once; close the bar, if there is one."""
        errors, self._errors = self._errors, {}
        for message, count in errors.values():
            if count > 1:
                say(self.bar, f"lora-sampler: {count} lines failed with the same error as {_shortened(message)}")
        if self.bar is not None:
            self.bar.close()

    def _show(self, **extra: Any) -> None:
        self.bar.set_postfix(retries=self._retries.value, failed=self._failed, **extra, refresh=False)


def error_key(message: str, record: Dict[str, Any]) -> str:
    """What makes two failed lines' errors the same: their message without the line's id and numbers."""
    if record.get("id") is not None:
        message = message.replace(f"(id {record['id']!r})", "(id)", 1)
    if record.get("custom_id") is not None:
        message = message.replace(f"custom_id {record['custom_id']!r}", "custom_id", 1)
    return _NUMBERS.sub("N", message)


def _shortened(message: str) -> str:
    return message if len(message) <= _SHORT_MESSAGE else message[: _SHORT_MESSAGE - 3] + "..."


def say(bar: Any, message: str) -> None:
    """Print a line on stderr, above the progress bar when there is one."""
    if bar is not None:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr)


class _BarHandler(logging.Handler):
    def __init__(self, bar: Any) -> None:
        super().__init__()
        self._bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        say(self._bar, self.format(record))


@contextlib.contextmanager
def logs_above(bar: Any) -> Iterator[None]:
    """Route lora_sampler's stderr log lines above the progress bar while it is shown."""
    package = logging.getLogger("lora_sampler")
    if bar is None:
        yield
        return
    handler = _BarHandler(bar)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    saved = [h for h in package.handlers if isinstance(h, logging.StreamHandler)]
    for h in saved:
        package.removeHandler(h)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        for h in saved:
            package.addHandler(h)


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
