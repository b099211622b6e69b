"""``replacing``: write a file that replaces another whole, or not at all. Stdlib only.

The new content goes to a temporary file beside the target (``.<name>.<8 random>.tmp``, same filesystem), is
fsynced, takes the target's mode, and moves over it with one ``os.replace``: a kill at any moment leaves the old
file or the new one, never a torn one. It decides nothing about what is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, BinaryIO, Dict, Iterator, Optional

#: The suffix of the temporary files, whose random part is tempfile's: 8 characters of ``[a-z0-9_]``.
TEMP_SUFFIX = ".tmp"


def temp_prefix(path: str) -> str:
    """Return the prefix of the temporary files that replace ``path``."""
    return f".{os.path.basename(path)}."


@contextlib.contextmanager
def replacing(path: str) -> Iterator[BinaryIO]:
    """Yield a binary file whose content replaces ``path`` when the block ends; on an error ``path`` is untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileNotFoundError):
            shutil.copymode(path, temp)  # the replaced file's permissions, not mkstemp's 0600
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def json_object_line(raw: bytes) -> Optional[Dict[str, Any]]:
    """One line of an append-only JSONL record file as its object, or None when it cannot be one.

    A line without its newline was torn by a kill mid-write, and a line that is not a JSON object was never ours:
    both are passed over, so a reader after a crash sees exactly the records that were written whole.
    """
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None
