"""Cancelling requests in flight: which pooled connection each thread's request is on, and shutting it down.

A ``CancelScope`` groups the requests of one fan-out (or of a client's ``submit`` calls). A worker runs a request
through ``scope.run``; ``scope.cancel()`` then shuts down the socket each of those requests is using right
now, so a read blocked on a long generation returns at once and the engine sees its client go away (vLLM aborts
such a request), and refuses every request of the scope that tries to start or send afterwards.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Callable, Dict, Optional, Set, Tuple, TypeVar

import urllib3

from lora_sampler.errors import RequestCancelledError

_local = threading.local()
T = TypeVar("T")


class _Slot:
    """One thread's view: the connection its current request sent on (None between requests)."""

    __slots__ = ("connection",)

    def __init__(self) -> None:
        self.connection: Any = None


def _slot() -> _Slot:
    slot: Optional[_Slot] = getattr(_local, "slot", None)
    if slot is None:
        slot = _local.slot = _Slot()
    return slot


def current_scope() -> Optional[CancelScope]:
    """Return the scope the calling thread's request runs in, or None."""
    scope: Optional[CancelScope] = getattr(_local, "scope", None)
    return scope


def is_cancelled() -> bool:
    """Tell whether the calling thread's request belongs to a cancelled scope (it must not send again)."""
    scope = current_scope()
    return scope is not None and scope.cancelled


class CancelScope:
    """The requests of one fan-out, and the connections they are using right now."""

    def __init__(self) -> None:
        self.cancelled = False
        self._lock = threading.Lock()
        self._slots: Set[_Slot] = set()

    def enter(self) -> Tuple[_Slot, Optional[CancelScope]]:
        """Start one request of this scope in the calling thread; pass what it returns to ``leave``.

        Raises:
            RequestCancelledError: the scope was cancelled before the request started.
        """
        slot = _slot()
        with self._lock:
            if self.cancelled:
                raise RequestCancelledError("not sent: the requests it was submitted with were cancelled")
            self._slots.add(slot)
        previous: Optional[CancelScope] = getattr(_local, "scope", None)
        _local.scope = self
        return slot, previous

    def leave(self, entered: Tuple[_Slot, Optional[CancelScope]]) -> None:
        """End the request ``enter`` started."""
        slot, previous = entered
        _local.scope = previous
        with self._lock:
            self._slots.discard(slot)
        slot.connection = None

    def run(self, call: Callable[[Any], T], argument: Any) -> T:
        """Return ``call(argument)`` run as one request of this scope (what a worker thread runs)."""
        entered = self.enter()
        try:
            return call(argument)
        finally:
            self.leave(entered)

    def cancel(self) -> None:
        """Refuse the scope's later requests and shut down the sockets of those in flight. Idempotent, quick."""
        with self._lock:
            self.cancelled = True
            slots = list(self._slots)
        for slot in slots:
            connection = slot.connection
            # The slot's connection may since have gone back to the pool and on to another thread's request.
            if connection is not None and getattr(connection, "_lora_sampler_slot", None) is slot:
                sock = getattr(connection, "sock", None)
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)


class _Tracked:
    """Mixed into a pool's connection class: each request records itself as its thread's current connection."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        slot = _slot()
        slot.connection = self
        self._lora_sampler_slot = slot
        if is_cancelled():  # the scope was cancelled between the request's start and this send
            raise ConnectionAbortedError("request cancelled")
        return super().request(*args, **kwargs)  # type: ignore[misc]


_TRACKED_CLASSES: Dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def track_connections(pool: urllib3.HTTPConnectionPool) -> None:
    """Make ``pool`` open connections whose requests a ``CancelScope`` can shut down (before it opened any)."""
    base = pool.ConnectionCls
    with _CLASSES_LOCK:
        tracked = _TRACKED_CLASSES.get(base)
        if tracked is None:
            tracked = _TRACKED_CLASSES[base] = type(f"Tracked{base.__name__}", (_Tracked, base), {})
    pool.ConnectionCls = tracked
