"""``replacing``: write a file that replaces another whole, or not at all; ``try_flock``, the one ``flock``.

The new content goes to a temporary file beside the target (``.<name>.<8 random>.tmp``, same filesystem), is
fsynced, takes the target's mode (a new target: what ``open`` gives a new file), and moves over it with one
``os.replace``: a kill at any moment leaves the old file or the new one, never a torn one. It decides nothing about
what is written. Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
from typing import Any, BinaryIO, Dict, Iterator, Optional, Tuple

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: nothing is locked (each caller says what that leaves to the user)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Whether ``flock`` exists here (not on Windows).
HAS_FLOCK = fcntl is not None

#: The suffix of the temporary files, whose random part is 8 characters of ``[a-z0-9_]`` (tempfile's alphabet, which
#: older versions used; now hexadecimal digits).
TEMP_SUFFIX = ".tmp"
#: Binary mode where the platform has one (Windows).
_BINARY = getattr(os, "O_BINARY", 0)


def temp_prefix(path: str) -> str:
    """Return the prefix of the temporary files that replace ``path``."""
    return f".{os.path.basename(path)}."


@contextlib.contextmanager
def replacing(path: str, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file whose content replaces ``path`` when the block ends; on an error ``path`` is untouched.

    ``durable=False`` skips the fsync (the replacement is still whole, but a power cut may lose it).
    """
    fd, temp = _new_temporary(path)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            if durable:
                out.flush()
                os.fsync(out.fileno())
        with contextlib.suppress(FileNotFoundError):
            shutil.copymode(path, temp)  # the replaced file's permissions
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _new_temporary(path: str) -> Tuple[int, str]:
    """Create a temporary file beside ``path`` that no one else has (``O_EXCL``), with the mode ``open`` gives a new
    file (0666 less the umask; mkstemp's 0600 would hide a new output from the other users of a shared folder)."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        temp = os.path.join(directory, f"{temp_prefix(path)}{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _BINARY, 0o666), temp
        except FileExistsError:  # 1 in 4 billion: draw again
            continue


def json_object_line(raw: bytes) -> Optional[Dict[str, Any]]:
    """One line of an append-only JSONL record file as its object, or None when it cannot be one.

    A line without its newline was torn by a kill mid-write, and a line that is not a JSON object was never ours:
    both are passed over, so a reader after a crash sees exactly the records that were written whole.
    """
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deep to decode
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
