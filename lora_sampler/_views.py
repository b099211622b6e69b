"""Text safe to print on a terminal (``printable``: how a checkpoint's name or a path shows in a line of output), and
numbers safe to write as JSON (``json_number``).

How sampling results show (their repr, notebook table and plain-dict form) is the value types' own
(``lora_sampler.types``). Pure functions; no I/O.
"""

from __future__ import annotations

import math
from typing import Optional


def json_number(value: Optional[float]) -> Optional[float]:
    """Return ``value``, or None for NaN and infinities (which JSON cannot hold)."""
    return None if value is None or not math.isfinite(value) else value


def printable(text: str) -> str:
    """Return ``text`` safe to print on a terminal: control characters (newlines, escapes that move the cursor or
    recolour it, bidirectional overrides) as backslash escapes, everything printable as it is.

    A checkpoint may be named anything a filesystem allows; printed raw, a name with a newline forges a log line and
    one with ``\\x1b[`` rewrites the terminal.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)
