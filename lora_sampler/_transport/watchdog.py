"""The deadline of every exchange in flight, kept by one thread that cuts those whose deadline passed.

A per-read socket timeout never trips on a server that drips its status line, its headers or its body one byte at
a time. Each exchange is armed here with its deadline: the earlier of ``connect + read`` seconds after it started
and ``read`` seconds after its request was sent (``Slot.sent``). One daemon thread sleeps until the earliest
deadline and cuts what is due (``Slot.cut_now``: its socket is shut down, so the blocked read returns at once).
Arming and disarming are a dictionary update under a lock; the thread wakes only when some deadline is due.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Dict, Optional, Tuple

from lora_sampler._transport.connections import CUT_DEADLINE, Slot


def answer_deadline(slot: Slot, overall: float, read: float) -> float:
    """Return when the exchange in ``slot`` must be over: by ``overall``, and ``read`` after its request was sent."""
    return min(overall, slot.sent + read) if slot.sent else overall


class Watchdog:
    """Cuts each armed exchange once its deadline passes; one daemon thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._armed: Dict[Slot, Tuple[float, float]] = {}
        self._next = math.inf
        self._thread: Optional[threading.Thread] = None

    def arm(self, slot: Slot, started: float, overall: float, read: float) -> None:
        """Watch the exchange in ``slot``, started at ``started``: cut it at ``answer_deadline``."""
        with self._lock:
            self._armed[slot] = (overall, read)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lora-sampler-deadline-watchdog", daemon=True)
                self._thread.start()
            # The deadline is at least started + read; wake the thread only if that is before its next wake-up
            # (rare: most exchanges share one timeout, so each new deadline is later than those armed before).
            if min(overall, started + read) < self._next:
                self._wakeup.notify()

    def disarm(self, slot: Slot) -> None:
        """Stop watching ``slot`` (its exchange is over)."""
        with self._lock:
            self._armed.pop(slot, None)

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                soonest = math.inf
                for slot, (overall, read) in list(self._armed.items()):
                    deadline = answer_deadline(slot, overall, read)
                    if deadline <= now:
                        del self._armed[slot]
                        slot.cut_now(CUT_DEADLINE)
                    elif slot.sent:
                        soonest = min(soonest, deadline)
                    else:
                        # Not sent yet: once it is, its deadline is ``read`` after that, so no earlier than now + read.
                        # Look again then (or at ``overall``), when it is known.
                        soonest = min(soonest, deadline, now + read)
                self._next = soonest
                self._wakeup.wait(None if soonest == math.inf else soonest - now)


_WATCHDOG = Watchdog()


def watchdog() -> Watchdog:
    """Return this process's watchdog."""
    return _WATCHDOG


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: it gets a watchdog of its own, started on first use."""
    global _WATCHDOG
    _WATCHDOG = Watchdog()


if hasattr(os, "register_at_fork"):  # POSIX only; a process that cannot fork needs no reset
    os.register_at_fork(after_in_child=_after_fork_in_child)
