"""Which pooled connection each thread's exchange is on, and cutting it: by its deadline, or when its work is cancelled.

urllib3 builds a pool's connections from the pool class's ``ConnectionCls``, a documented attribute of
``urllib3.HTTPConnectionPool`` (https://urllib3.readthedocs.io/en/stable/reference/urllib3.connectionpool.html).
The pools here use connection subclasses that, when a request is sent on them, record themselves in the sending
thread's ``Slot``. Cutting a slot shuts down the socket of the connection it records, so a read blocked in the
standard library returns at once, and the engine sees its client go away (vLLM aborts such a request). Two things
cut slots:

- the ``Watchdog``: a per-read socket timeout never trips on a server that drips its status line, its headers or its
  body one byte at a time. Each exchange is armed with its deadline: the earlier of ``connect + read`` seconds after
  it started and ``read`` seconds after its request was sent (``Slot.sent``). One daemon thread sleeps until the
  earliest deadline and cuts what is due. Arming and disarming are a dictionary update under a lock; the thread
  wakes only when some deadline is due.
- a ``CancelScope``: the requests of one fan-out (or of a client's ``submit`` calls). A worker runs a request through
  ``scope.run``; ``scope.cancel()`` cancels what the scope holds that has not started, cuts each of its threads'
  exchanges, and refuses every request of the scope that tries to start or send afterwards.

Nothing here reads an answer or knows a URL.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Protocol, Set, Tuple, TypeVar

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from lora_sampler.errors import RequestCancelledError

T = TypeVar("T")

#: Why a slot was cut: its answer's deadline passed, or its fan-out was cancelled.
CUT_DEADLINE = "deadline"
CUT_CANCELLED = "cancelled"


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
        #: The cancel scope the thread's requests run in (set by ``CancelScope.run``), or None.
        self.scope: Optional[CancelScope] = None

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


def is_cancelled() -> bool:
    """Tell whether the calling thread's request belongs to a cancelled scope (it must not send again)."""
    scope = current_slot().scope
    return scope is not None and scope.cancelled


class _Cancellable(Protocol):
    def cancel(self) -> bool: ...


class CancelScope:
    """The requests of one fan-out (or of a client's ``submit`` calls): what waits to start, and the threads running
    them right now.

    It holds what cancels a request not started yet (a future, or a batch of them) weakly, and each thread's slot while
    the thread runs one of its requests.
    """

    def __init__(self) -> None:
        self.cancelled = False
        #: Guards the scope; the fan-out's batching shares it (one lock a fan-out).
        self.lock = threading.Lock()
        self._slots: Set[Slot] = set()
        self._pending: weakref.WeakSet[_Cancellable] = weakref.WeakSet()

    def add(self, item: _Cancellable) -> None:
        """Hold ``item`` (a future or a batch not started yet): ``cancel`` cancels it."""
        with self.lock:
            self._pending.add(item)

    def run(self, call: Callable[[Any], T], argument: Any) -> T:
        """Return ``call(argument)`` run as one request of this scope (what a worker thread runs).

        Raises:
            RequestCancelledError: the scope was cancelled before the request started.
        """
        slot = current_slot()
        with self.lock:
            if self.cancelled:
                raise RequestCancelledError("not sent: the requests it was submitted with were cancelled")
            self._slots.add(slot)
        previous, slot.scope = slot.scope, self
        try:
            return call(argument)
        finally:
            slot.scope = previous
            with self.lock:
                self._slots.discard(slot)

    def cancel(self) -> None:
        """Cancel what has not started, refuse the scope's later requests and shut down the sockets of those in
        flight. Idempotent, quick."""
        with self.lock:
            self.cancelled = True
            slots, pending = list(self._slots), list(self._pending)
        for item in pending:  # first, so a worker freed by a shut connection does not start one of them
            item.cancel()
        for slot in slots:
            slot.cut_now(CUT_CANCELLED)


def answer_deadline(slot: Slot, overall: float, read: float) -> float:
    """Return when the exchange in ``slot`` must be over: by ``overall``, and ``read`` after its request was sent."""
    return min(overall, slot.sent + read) if slot.sent else overall


class Watchdog:
    """Cuts each armed exchange once its deadline passes; one daemon thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken on every exchange: a plain lock (a Condition's is a Python-level call)
        self._wakeup = threading.Condition(self._lock)
        self._armed: Dict[Slot, Tuple[float, float]] = {}
        self._next = math.inf
        self._thread: Optional[threading.Thread] = None

    def arm(self, slot: Slot, connect: float, read: float) -> float:
        """Begin an exchange in ``slot`` now and watch it: cut it at ``answer_deadline``; return its overall deadline
        (``connect + read`` seconds from now)."""
        slot.begin()
        started = time.monotonic()
        overall = started + connect + read
        with self._lock:
            self._armed[slot] = (overall, read)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lora-sampler-deadline-watchdog", daemon=True)
                self._thread.start()
            # The deadline is at least started + read; wake the thread only if that is before its next wake-up
            # (rare: most exchanges share one timeout, so each new deadline is later than those armed before).
            if min(overall, started + read) < self._next:
                self._wakeup.notify()
        return overall

    def disarm(self, slot: Slot) -> None:
        """Stop watching ``slot`` and end its exchange: no cut can reach its connection any more."""
        with self._lock:
            self._armed.pop(slot, None)
        slot.end()

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
    """A forked child starts with fresh slots (a parent's thread may have held one's lock at the fork) and a watchdog
    of its own, started on first use (it has none of its parent's threads)."""
    global _local, _WATCHDOG
    _local = threading.local()
    _WATCHDOG = Watchdog()


if hasattr(os, "register_at_fork"):  # POSIX only; a process that cannot fork needs no reset
    os.register_at_fork(after_in_child=_after_fork_in_child)
