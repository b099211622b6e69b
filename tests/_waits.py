"""Waiting in tests for what a test waits for (a state, a line, a count), never for a fixed time.

A wait ends as soon as its condition holds; its deadline is generous (a loaded machine is slow, not wrong), so
reaching it means the condition never came, and the failure says which.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

#: Seconds a wait gives its condition: far above what any of them takes on an idle machine.
DEADLINE = 60.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"after {timeout:g} s: {what}"
        time.sleep(0.005)


def blocked_in(thread: threading.Thread, function: Callable[..., Any]) -> bool:
    """Whether ``thread`` is blocked in a ``threading.Condition.wait`` (a lock, an event, a future) called from
    ``function``, read from its stack (``sys._current_frames``): a thread known to wait there, not one about to.

    Args:
        thread: A started thread.
        function: A plain function or method (``OutageGate.run``), looked for anywhere below the wait.
    """
    frame = sys._current_frames().get(thread.ident or 0)
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    return bool(codes) and codes[0] is threading.Condition.wait.__code__ and function.__code__ in codes
