"""What FakeEngine lets a test observe: the request log (``RequestRecord``) and the connection and load counters.

Owns the records and counters and their locked queries; it decides nothing about answers, faults or adapters,
and holds no lock of its own: it shares the engine's. Stdlib only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any, Protocol

from lora_sampler._wire.routes import SESSION_HEADER


class AnsweredRequest(Protocol):
    """What a record reads of the request it logs (``_server.Handler``, the stdlib's request handler)."""

    @property
    def command(self) -> str: ...
    @property
    def headers(self) -> Message: ...


@dataclass(frozen=True)
class RequestRecord:
    """One request as the engine saw it; ``status`` is 0 when a fault answered nothing.

    ``model`` is the body's ``model`` (``lora_name`` for load/unload); ``fault`` the injected fault kind, or
    "aborted" for a completion whose client hung up while it was generated; ``prompts`` the number of prompts a
    completion held (0 for other requests, and for a completion refused before its prompts were read). The
    Authorization value is never kept.
    """

    method: str
    path: str
    model: str | None
    status: int
    session_id: str | None
    has_auth: bool
    started: float
    finished: float
    fault: str | None = None
    #: Body fields beyond those lora_sampler always sends (vLLM's extra parameters, e.g. ``min_tokens``), as
    #: ``(name, value)`` pairs; empty for most requests, so the log stays small.
    extra_fields: tuple[tuple[str, Any], ...] = ()
    prompts: int = 0


#: Body fields every completion or chat request carries: the log keeps only the others (``extra_fields``).
USUAL_FIELDS = frozenset(
    {"model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k"}
    | {"seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "return_token_ids", "prompt_logprobs"}
    | {"lora_name", "lora_path", "load_inplace"}
)


def new_record(
    handler: AnsweredRequest,
    path: str,
    model: str | None,
    status: int,
    started: float,
    fault: str | None,
    payload: Any = None,
    prompts: int = 0,
) -> RequestRecord:
    """The record of a request answered now (the Authorization header's value is not kept)."""
    extra: tuple[tuple[str, Any], ...] = ()
    if isinstance(payload, dict) and not payload.keys() <= USUAL_FIELDS:
        extra = tuple((key, value) for key, value in payload.items() if key not in USUAL_FIELDS)
    return RequestRecord(
        method=handler.command,
        path=path,
        model=model,
        status=status,
        session_id=handler.headers.get(SESSION_HEADER),
        has_auth="Authorization" in handler.headers,
        started=started,
        finished=time.monotonic(),
        fault=fault,
        extra_fields=extra,
        prompts=prompts,
    )


class EngineStats:
    """The request log and counters. Plain attributes and ``*_locked`` methods expect the caller to hold ``lock``;
    the other methods take it themselves. Unlocked reads of a single counter are fine (ints are replaced whole).
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.records: list[RequestRecord] = []
        self.in_flight = self.opened = self.loads = self.max_loads = self.lazy_loads = self.aborted = 0
        self._loads_by_name: dict[str, int] = {}
        self._max_loads_by_name: dict[str, int] = {}
        self.swaps = 0
        self.swap_log: list[tuple[float, str]] = []  # (monotonic time, adapter) of each swap into a slot

    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self.records)

    def calls(self, path: str, model: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.records if r.path == path and (model is None or r.model == model))

    def reset(self) -> None:
        """Clear the log, the connection count, the load peaks and the swaps (not the loads in flight)."""
        with self._lock:
            self.records.clear()
            self.opened = self.max_loads = self.lazy_loads = self.swaps = self.aborted = 0
            self.swap_log.clear()
            self._max_loads_by_name.clear()

    def max_loads_for(self, name: str) -> int:
        with self._lock:
            return self._max_loads_by_name.get(name, 0)

    def load_started_locked(self, name: str) -> None:
        self.loads += 1
        self._loads_by_name[name] = self._loads_by_name.get(name, 0) + 1
        self.max_loads = max(self.max_loads, self.loads)
        self._max_loads_by_name[name] = max(self._max_loads_by_name.get(name, 0), self._loads_by_name[name])

    def swap_started_locked(self, name: str) -> None:
        self.swaps += 1
        self.swap_log.append((time.monotonic(), name))

    def load_finished_locked(self, name: str) -> None:
        self.loads -= 1
        self._loads_by_name[name] -= 1
