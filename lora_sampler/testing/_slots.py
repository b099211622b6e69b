"""FakeEngine's adapter slots: the adapters a running batch may hold at once, and the cost of swapping one in.

vLLM's scheduler puts requests of at most ``--max-loras`` adapters in a batch; a request for another adapter waits
until a slot is idle, and swapping the adapter in costs time. Opt-in (``lora_slots=``); stdlib only; it shares the
engine's lock and counts swaps in the engine's stats.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    from lora_sampler.testing._lifecycle import Lifecycle

_WAIT_STEP = 0.05  # how often a waiting request looks at the engine's stop and death


class SlotSettings(Protocol):
    """The engine settings the slots read live (``FakeEngine``'s attributes, which a test may change)."""

    @property
    def model(self) -> str: ...
    @property
    def lora_slots(self) -> int | None: ...
    @property
    def swap_latency(self) -> float: ...


class AdapterSlots:
    """``lora_slots`` slots, each holding one adapter and counting the requests using it.

    A request for an adapter in a slot runs at once. Otherwise it waits for a free slot or an idle one (no request
    using it; the least recently used goes), then the adapter is swapped in for ``swap_latency`` seconds, during
    which other requests for it wait too. Every swap is counted (``EngineStats.swaps``, ``swap_log``).
    """

    def __init__(self, engine: SlotSettings, lifecycle: Lifecycle) -> None:
        self._engine, self._lifecycle, self._stats = engine, lifecycle, lifecycle.stats
        self._changed = threading.Condition(lifecycle.lock)
        self._users: OrderedDict[str, int] = OrderedDict()  # adapter -> requests using it, least recent first
        self._swapping: set[str] = set()

    def held(self) -> list[str]:
        """The adapters in slots now, least recently used first."""
        with self._changed:
            return list(self._users)

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """Hold a slot for ``name`` for the block; no slot for the base model or without ``lora_slots``."""
        engine = self._engine
        held = engine.lora_slots is not None and name != engine.model and self.acquire(name)
        try:
            yield
        finally:
            if held:
                self.release(name)

    def acquire(self, name: str) -> bool:
        """Take a slot for ``name`` (swapping it in when it holds none); False once the engine stopped first."""
        with self._changed:
            while not self._take_locked(name):
                if self._lifecycle.wake.is_set():
                    return False
                self._changed.wait(_WAIT_STEP)
            if name not in self._swapping:
                return True
        try:
            self._lifecycle.pause(lambda: self._engine.swap_latency)
        finally:
            with self._changed:
                self._swapping.discard(name)
                self._changed.notify_all()
        return True

    def release(self, name: str) -> None:
        """Give back the slot use of one finished request for ``name``."""
        with self._changed:
            if self._users.get(name, 0) > 0:
                self._users[name] -= 1
                self._changed.notify_all()

    def _take_locked(self, name: str) -> bool:
        """Count a use of ``name``'s slot, evicting an idle adapter when needed; False when it must wait."""
        if name in self._users:
            if name in self._swapping:
                return False  # being swapped in by another request: wait for it to finish
            self._users[name] += 1
            self._users.move_to_end(name)
            return True
        if len(self._users) >= max(1, int(self._engine.lora_slots or 1)):
            idle = next((held for held, users in self._users.items() if users == 0), None)
            if idle is None:
                return False
            del self._users[idle]
        self._users[name] = 1
        self._swapping.add(name)
        self._stats.swap_started_locked(name)
        return True
