"""Waiting in tests for what a test waits for (a state, a line, a count), never for a fixed time.

A wait ends as soon as its condition holds; its deadline is generous (a loaded machine is slow, not wrong), so
reaching it means the condition never came, and the failure says which.
"""

from __future__ import annotations

import time
from typing import Callable

#: Seconds a wait gives its condition: far above what any of them takes on an idle machine.
DEADLINE = 60.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"after {timeout:g} s: {what}"
        time.sleep(0.005)
