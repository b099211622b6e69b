"""Cancelling requests in flight: the threads running one fan-out's requests, and cutting their exchanges.

A ``CancelScope`` groups the requests of one fan-out (or of a client's ``submit`` calls). A worker runs a request
through ``scope.run``; ``scope.cancel()`` then cuts each of those threads' exchanges (``connections.Slot``): the
socket a request is using right now is shut down, so a read blocked on a long generation returns at once and the
engine sees its client go away (vLLM aborts such a request), and every request of the scope that tries to start or
send afterwards is refused.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Set, Tuple, TypeVar

from lora_sampler._transport.connections import CUT_CANCELLED, Cancellable, Slot, current_slot
from lora_sampler.errors import RequestCancelledError

T = TypeVar("T")


def is_cancelled() -> bool:
    """Tell whether the calling thread's request belongs to a cancelled scope (it must not send again)."""
    scope = current_slot().scope
    return scope is not None and scope.cancelled


class CancelScope:
    """The requests of one fan-out, and the threads running them right now."""

    def __init__(self) -> None:
        self.cancelled = False
        self._lock = threading.Lock()
        self._slots: Set[Slot] = set()

    def enter(self) -> Tuple[Slot, Optional[Cancellable]]:
        """Start one request of this scope in the calling thread; pass what it returns to ``leave``.

        Raises:
            RequestCancelledError: the scope was cancelled before the request started.
        """
        slot = current_slot()
        with self._lock:
            if self.cancelled:
                raise RequestCancelledError("not sent: the requests it was submitted with were cancelled")
            self._slots.add(slot)
        previous, slot.scope = slot.scope, self
        return slot, previous

    def leave(self, entered: Tuple[Slot, Optional[Cancellable]]) -> None:
        """End the request ``enter`` started."""
        slot, previous = entered
        slot.scope = previous
        with self._lock:
            self._slots.discard(slot)

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
            slot.cut_now(CUT_CANCELLED)
