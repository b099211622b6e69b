"""Leases on published adapter folders: a folder another process uses is never deleted under it.

A process that publishes or resolves an adapter holds a shared ``flock`` on ``<lora_base_dir>/.leases/<name>.lease``
for as long as it may send requests for it. A clean-up (``--delete-retired``, ``lora-sampler adapters``) deletes a
folder only after it got the exclusive lock without waiting, i.e. while nobody holds a lease. The kernel releases a
lock when its process dies (even on SIGKILL), so a killed run never pins a folder forever.

The lease folder starts with a dot: adapter names never do, so vLLM's resolver never takes it for an adapter, and
listings of the resolver folder skip it. On a filesystem without ``flock`` (or on Windows) no lease is held and a
clean-up deletes nothing it would need a lease for: it says so in the log. On NFS, ``flock`` is mapped onto the
server's byte-range locks (Linux 2.6.12 and later), which other clients see unless the share is mounted with
``nolock`` or ``local_lock=flock``; a crashed client's locks go when the server's lease on it expires.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional, Union

from lora_sampler._files import HAS_FLOCK, try_flock
from lora_sampler.errors import LoraSamplerError
from lora_sampler.names import validate_adapter_name

logger = logging.getLogger(__name__)

#: The hidden folder in the resolver folder that holds one lease file per adapter name.
LEASE_FOLDER = ".leases"
#: Seconds ``hold`` waits for a clean-up that holds the exclusive lock (it holds it only across one rename).
HOLD_WAIT_SECONDS = 30.0
_RETRY_SECONDS = 0.01

StrPath = Union[str, "os.PathLike[str]"]


def lease_path(base_dir: StrPath, name: str) -> str:
    """Return the lease file of adapter ``name`` in the resolver folder ``base_dir``."""
    validate_adapter_name(name)  # one path component: the lease file stays inside .leases
    return os.path.join(os.path.abspath(os.fspath(base_dir)), LEASE_FOLDER, f"{name}.lease")


class Lease:
    """A held lease on one adapter folder; ``release()`` (or the process's end) lets a clean-up delete it.

    Attributes:
        name: The adapter name.
        path: The lease file.
        held: False where the filesystem has no locks (nothing protects the folder then).
    """

    def __init__(self, name: str, path: str, fd: int):
        self.name, self.path = name, path
        self._fd = fd
        self._lock = threading.Lock()
        if fd >= 0:
            _LIVE.add(self)

    def drop_in_child(self) -> None:
        """In a forked child: close the inherited descriptor without touching the parent's lock."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # the lock stays with the parent's descriptor of the same open file

    @property
    def held(self) -> bool:
        """Whether the shared lock is held now."""
        return self._fd >= 0

    def release(self) -> None:
        """Let go of the lease (closing the descriptor drops the lock); the last holder removes the lease file, and
        the lease folder once it is empty, so a resolver folder keeps no trace of runs that ended. Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            _remove_if_last(fd, self.path)  # the lease file alone: the folder is the clean-up's to remove

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self.name!r}, held={self.held})"


#: Leases held in this process, so a forked child drops its inherited copies (see ``_drop_leases_in_child``).
_LIVE: weakref.WeakSet[Lease] = weakref.WeakSet()


def _drop_leases_in_child() -> None:
    """A forked child shares its parent's lock (one open file): it closes its copies, so the parent's release and
    its clean-up on release act on the parent's lease alone, and a long-lived child never pins a folder."""
    for lease in list(_LIVE):
        lease.drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_leases_in_child)


def hold(base_dir: StrPath, name: str, *, wait: float = HOLD_WAIT_SECONDS) -> Lease:
    """Take a shared lease on adapter ``name``'s folder in ``base_dir`` (any number of holders at once).

    Waits (at most ``wait`` seconds) only while a clean-up holds the exclusive lock, which it does across one
    rename. Where locks do not work, returns a lease that holds nothing (``held`` is False) and logs why.

    Raises:
        LoraSamplerError: a clean-up held the folder for ``wait`` seconds.
        ValueError: ``name`` is not a valid adapter name.
    """
    path = lease_path(base_dir, name)
    if not HAS_FLOCK:  # pragma: no cover - Windows: no leases, and nothing is deleted that would need one
        return Lease(name, path, -1)
    deadline = time.monotonic() + wait
    while True:
        fd = _open_lease_file(path)
        if fd is None:
            return Lease(name, path, -1)
        held = try_flock(fd, path, shared=True, unlocked=f"other runs' clean-ups cannot see that {name} is in use")
        if held and _still_there(fd, path):
            return Lease(name, path, fd)
        os.close(fd)  # held: a clean-up removed that lease file meanwhile, lock the new one
        if held is None:  # a filesystem without locks
            return Lease(name, path, -1)
        if held is False:  # a clean-up holds it, across one rename
            if time.monotonic() >= deadline:
                raise LoraSamplerError(
                    f"cannot lease the adapter folder {name}: a clean-up held {path} for {wait:g} s; run again"
                )
            time.sleep(_RETRY_SECONDS)


def remove_if_unleased(base_dir: StrPath, name: str) -> bool:
    """Delete adapter ``name``'s folder in ``base_dir`` unless some process holds a lease on it.

    The exclusive lock is tried without waiting and held across the folder's atomic rename away, so a process that
    takes a lease afterwards finds the folder gone (and publishes it again), never half-deleted. Unload the adapter
    from the engine first.

    Returns:
        True when nobody held a lease (the folder is gone, or was not there); False when it was kept: a lease is
        held, or the filesystem has no locks (then nothing can tell whether another run uses it).

    Raises:
        ValueError: ``name`` is not a valid adapter name.
    """
    from lora_sampler._adapters.publish import remove_adapter_dir

    path = lease_path(base_dir, name)
    if not HAS_FLOCK:  # pragma: no cover - Windows
        return False
    fd = _open_lease_file(path)
    if fd is None:
        return False
    return _remove_if_last(fd, path, lambda: remove_adapter_dir(base_dir, name), f"the folder of {name} is kept")


def leased(base_dir: StrPath, name: str) -> Optional[bool]:
    """Tell whether some process holds a lease on ``name`` now (None where locks do not work). For listings."""
    path = lease_path(base_dir, name)
    if not HAS_FLOCK:  # pragma: no cover - Windows
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        held = try_flock(fd, path)
    finally:
        os.close(fd)  # drops the probe's lock too
    return None if held is None else not held


def _open_lease_file(path: str) -> Optional[int]:
    # The last holder of another lease may remove the empty folder at any moment: between the two calls (the open
    # finds no folder), or inside makedirs, between its mkdir ("exists") and its check (now gone), where it raises
    # FileExistsError. Both are a folder that vanished: make it again.
    for _ in range(100):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # NFS grants an exclusive lock only on a file open for writing.
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, FileExistsError):
            continue
        except OSError as error:  # a read-only resolver folder: nothing can be leased (nor deleted) here
            logger.warning("cannot open the lease file %s (%s)", path, error)
            return None
    logger.warning("cannot open the lease file %s: its folder keeps vanishing", path)
    return None


def _remove_if_last(
    fd: int, path: str, remove_folder: Optional[Callable[[], object]] = None, unlocked: str = ""
) -> bool:
    """Close ``fd`` (a holder's, or a clean-up's); before, if no one else holds the lease, remove the adapter's
    folder (``remove_folder``, a clean-up's) and the lease file (and the lease folder once empty).

    Both go under the exclusive lock, tried without waiting, so a holder that opened the lease file meanwhile sees
    it gone, re-opens the path and finds no folder, never a half-deleted one.

    Returns:
        Whether they were removed: False while another holder has the lease, where locks do not work (``unlocked``
        is what the warning says that leaves), or when another clean-up was first (it removed them).
    """
    try:
        if not try_flock(fd, path, unlocked=unlocked) or not _still_there(fd, path):
            return False
        if remove_folder is not None:
            remove_folder()
        _remove_lease_file(path)
        return True
    finally:
        os.close(fd)


def _remove_lease_file(path: str) -> None:
    """Unlink a lease file (its holder has the exclusive lock), and the lease folder once no other lease is in it."""
    os.unlink(path)
    with contextlib.suppress(OSError):  # other leases live there
        os.rmdir(os.path.dirname(path))


def _still_there(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a clean-up unlinks a lease file under its exclusive lock)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
