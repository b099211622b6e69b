"""Single-flight proactive adapter loads: at most one ``load_lora_adapter`` in flight per adapter per client.

Threads that hit the adapter-load race together share one load per backoff round: the first thread to fail in a
round sends it; the others skip it and just wait their own backoff. No HTTP here; the sender is handed in.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict

logger = logging.getLogger(__name__)


@dataclass
class _LoadState:
    in_flight: bool = False
    #: Highest retry round (the failed attempt number) that has already sent a load.
    round_loaded: int = 0
    last_started: float = float("-inf")


class AdapterLoadCoordinator:
    """Decides which failed attempt sends the proactive load, so racing threads send one per round.

    Args:
        episode_gap: Seconds after the last load after which a failure starts a new episode (round numbers from
            an earlier, finished race no longer suppress loads).
    """

    def __init__(self, episode_gap: float):
        self._episode_gap = episode_gap
        self._lock = threading.Lock()
        self._states: Dict[str, _LoadState] = {}

    def load_if_due(self, name: str, attempt: int, send_load: Callable[[], None]) -> bool:
        """Send ``send_load()`` unless a load for ``name`` is in flight or this round already had one.

        Args:
            name: The adapter name.
            attempt: The attempt number that just failed (the retry round).
            send_load: Sends the load; runs outside the lock, so other threads never wait on it.

        Returns:
            Whether this call sent the load.
        """
        now = time.monotonic()
        with self._lock:
            state = self._states.setdefault(name, _LoadState())
            if state.in_flight:
                return False
            if now - state.last_started > self._episode_gap:
                state.round_loaded = 0
            if attempt <= state.round_loaded:
                return False
            state.in_flight, state.round_loaded, state.last_started = True, attempt, now
        try:
            send_load()
        finally:
            with self._lock:
                state.in_flight = False
        return True

    def forget(self, name: str) -> None:
        """End the race for ``name`` (it served a request, or was unloaded): the next failure loads at once."""
        if name in self._states:  # unlocked peek: the success path of a sample stays lock-free
            with self._lock:
                self._states.pop(name, None)

    def forget_all(self) -> None:
        """End every race: the engine restarted, so loads sent before (or lost on the way) count for nothing."""
        with self._lock:
            self._states.clear()
