"""``replacing``: write a file that replaces another whole, or not at all; ``try_flock``, the one ``flock``.

The new content goes to a temporary file beside the target (``.<name>.<8 random>.tmp``, same filesystem), is
fsynced, takes the target's mode, and moves over it with one ``os.replace``: a kill at any moment leaves the old
file or the new one, never a torn one. It decides nothing about what is written. Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, BinaryIO, Dict, Iterator, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: nothing is locked (each caller says what that leaves to the user)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Whether ``flock`` exists here (not on Windows).
HAS_FLOCK = fcntl is not None

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


def try_flock(fd: int, path: str, *, shared: bool = False, wait: bool = False, unlocked: str = "") -> Optional[bool]:
    """Take ``flock`` on ``fd`` (the open file ``path``): True once held, False when another process holds it.

    None where locks do not work (Windows, or a filesystem without them): the caller goes on unlocked, and with
    ``unlocked`` (what that leaves to the user) a warning names the file, the error and it.

    Args:
        fd: The open file to lock; closing it releases the lock.
        path: The file, for the warning.
        shared: A shared lock (any number of holders) instead of an exclusive one.
        wait: Block until the lock is free instead of answering False.
        unlocked: What going on without the lock means, for the warning ("" logs nothing).
    """
    if fcntl is None:  # pragma: no cover - Windows
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as error:
        if unlocked:
            logger.warning("cannot lock %s (%s); %s", path, error, unlocked)
        return None
    return True
