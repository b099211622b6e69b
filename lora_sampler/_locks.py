"""``KeyedLocks``: one lock per key, forgotten once no thread holds or waits for it. Stdlib only.

Work on the same key (one checkpoint, one adapter name) runs one thread at a time while work on other keys runs in
parallel, and a sweep over thousands of keys leaves no lock behind. It guards no data: callers keep their state
under their own lock.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Hashable, Iterator


class _Entry:
    """One key's lock and the number of threads holding or waiting for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users = 0


class KeyedLocks:
    """A reentrant lock per key, made on first use and dropped when its last holder or waiter leaves."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: Dict[Hashable, _Entry] = {}

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold ``key``'s lock for the ``with`` block (the same thread may hold it again inside)."""
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]

    def __len__(self) -> int:
        """The number of keys with a lock right now (held or waited for)."""
        with self._guard:
            return len(self._entries)
