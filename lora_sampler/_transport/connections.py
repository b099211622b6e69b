"""Which pooled connection each thread's exchange is on, and cutting it: the handle for deadlines and Ctrl-C.

urllib3 builds a pool's connections from the pool class's ``ConnectionCls``, a documented attribute of
``urllib3.HTTPConnectionPool`` (https://urllib3.readthedocs.io/en/stable/reference/urllib3.connectionpool.html).
The pools here use connection subclasses that, when a request is sent on them, record themselves in the sending
thread's ``Slot``. Cutting a slot shuts down the socket of the connection it records, so a read blocked in the
standard library returns at once; the deadline watchdog and a cancelled fan-out both cut slots. Nothing here reads
an answer or knows a URL.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Optional, Protocol

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

#: Why a slot was cut: its answer's deadline passed, or its fan-out was cancelled.
CUT_DEADLINE = "deadline"
CUT_CANCELLED = "cancelled"


class Cancellable(Protocol):
    """What a slot reads of the cancel scope its thread's requests run in (``cancel.CancelScope``)."""

    @property
    def cancelled(self) -> bool: ...


class Slot:
    """One thread's exchange: the connection it is on, when its request was sent, and whether it was cut.

    A thread runs one exchange at a time, so it keeps one slot for its lifetime (``current_slot``).
    """

    __slots__ = ("_lock", "connection", "cut", "scope", "sent")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.connection: Optional[HTTPConnection] = None
        self.cut: Optional[str] = None
        self.sent = 0.0
        #: The cancel scope the thread's requests run in (set by ``CancelScope``), or None.
        self.scope: Optional[Cancellable] = None

    def begin(self) -> None:
        """Start an exchange on this thread: no connection yet, not sent, not cut."""
        with self._lock:
            self.connection, self.cut, self.sent = None, None, 0.0

    def end(self) -> None:
        """End the exchange: its connection may go back to the pool, and no cut can reach it any more."""
        with self._lock:
            self.connection = None

    def attach(self, connection: HTTPConnection) -> None:
        """Record ``connection`` as the one this exchange sends on.

        Raises:
            ConnectionAbortedError: the exchange was cut, or its fan-out cancelled, before it was sent.
        """
        with self._lock:
            if self.cut is not None or (self.scope is not None and self.scope.cancelled):
                raise ConnectionAbortedError("request not sent: it was cancelled or its deadline passed")
            self.connection = connection

    def cut_now(self, reason: str) -> None:
        """Shut down the socket this exchange is using (if any) and mark it cut; the first reason stays."""
        with self._lock:
            if self.cut is None:
                self.cut = reason
            connection = self.connection
            sock = None if connection is None else getattr(connection, "sock", None)
            if sock is not None:
                # Another thread is blocked reading this socket: shutdown (not close) wakes it with an
                # end-of-file or an error, and the engine sees its client go away (vLLM aborts the request).
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


_local = threading.local()


def current_slot() -> Slot:
    """Return the calling thread's slot (made on first use)."""
    slot: Optional[Slot] = getattr(_local, "slot", None)
    if slot is None:
        slot = _local.slot = Slot()
    return slot


def _after_fork_in_child() -> None:
    """A forked child starts with fresh slots: a parent's thread may have held one's lock at the fork."""
    global _local
    _local = threading.local()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Recording:
    """Mixed into urllib3's connection classes: each request records its connection in the thread's slot."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        slot = current_slot()
        slot.attach(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]
        if slot.cut is not None:  # cut while connecting (no socket to shut down yet): never wait for an answer
            raise ConnectionAbortedError("request cancelled or past its deadline before it was sent")
        slot.sent = time.monotonic()


class RecordingHTTPConnection(_Recording, HTTPConnection):
    """urllib3's ``HTTPConnection`` that records itself in the sending thread's slot."""


class RecordingHTTPSConnection(_Recording, HTTPSConnection):
    """urllib3's ``HTTPSConnection`` that records itself in the sending thread's slot."""


class RecordingHTTPConnectionPool(HTTPConnectionPool):
    """urllib3's pool, building ``RecordingHTTPConnection`` connections."""

    ConnectionCls = RecordingHTTPConnection


class RecordingHTTPSConnectionPool(HTTPSConnectionPool):
    """urllib3's TLS pool, building ``RecordingHTTPSConnection`` connections."""

    ConnectionCls = RecordingHTTPSConnection


__all__ = [
    "CUT_CANCELLED",
    "CUT_DEADLINE",
    "RecordingHTTPConnectionPool",
    "RecordingHTTPSConnectionPool",
    "Slot",
    "current_slot",
]
