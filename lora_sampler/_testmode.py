"""The testing switch: when on, every retry wait is 0 s and the attempts are kept. Stdlib only.

``set_testing`` flips it (as a call or a context manager); the retry policy reads it each time it computes a wait,
so the switch needs neither the client nor ``backoff``, and ``lora_sampler.testing`` can offer it on its own.
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_on = False


def set_testing(on: bool = True) -> contextlib.ExitStack:
    """Turn every retry wait into 0 s (attempts are kept), for users' own fast tests.

    Works as a call and as a context manager that restores the previous state::

        with lora_sampler.testing.set_testing():
            ...
    """
    global _on
    with _lock:
        previous, _on = _on, bool(on)
    restore = contextlib.ExitStack()  # its exit (the with block's end) puts the previous state back
    restore.callback(set_testing, previous)
    return restore


def is_testing() -> bool:
    """Tell whether the testing switch is on (read at wait time)."""
    return _on
