"""Scripted faults for FakeEngine: the queue ``inject_fault`` fills and the answer each fault gives.

Owns validating, matching and consuming scripted faults and turning one into a verbatim body (or no answer).
It does not log requests, route or speak HTTP, and holds no lock of its own: the engine's lock guards it.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody

#: The kinds accepted by ``FakeEngine.inject_fault``.
FAULT_KINDS = frozenset({"refuse", "drop", "hang", "status", "503"})


@dataclass
class Fault:
    kind: str
    model: str | None
    path: str
    remaining: int
    status: int
    seconds: float
    message: str | None


class FaultScript:
    """The scripted faults, first injected first matched. Every method expects the caller to hold the engine lock."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []

    @staticmethod
    def make(
        kind: str, model: str | None, path: str, count: int, status: int, seconds: float, message: str | None
    ) -> Fault:
        """Validate ``inject_fault``'s arguments (before any lock is taken) and build the fault."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {sorted(FAULT_KINDS)}, not {kind!r}")
        if count < 1:
            raise ValueError("count must be at least 1")
        return Fault(kind, model, path, count, status, seconds, message)

    def add(self, fault: Fault) -> None:
        self._faults.append(fault)

    def clear(self) -> None:
        self._faults.clear()

    def take(self, path: str, model: str | None) -> Fault | None:
        """Consume one use of the first fault matching ``path`` and ``model``; returns a copy of it, or None."""
        for fault in self._faults:
            if fault.path == path and (fault.model is None or fault.model == model):
                fault.remaining -= 1
                if not fault.remaining:
                    self._faults.remove(fault)
                return replace(fault)
        return None


def fault_answer(fault: Fault, *, old_shape: bool, sleep: Callable[[float], None]) -> VllmBody | None:
    """The body a fault answers with; None for refuse, drop and hang (after sleeping ``fault.seconds``)."""
    if fault.kind == "status":
        message = fault.message or f"scripted {fault.status}"
        return bodies.error(fault.status, message, _error_type(fault.status), old_shape=old_shape)
    if fault.kind == "503":
        return bodies.retry_later(old_shape=old_shape)
    if fault.kind == "hang":
        sleep(fault.seconds)
    return None  # refuse, drop, hang: no answer


def _error_type(status: int) -> str:
    names = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError"}
    return names.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
