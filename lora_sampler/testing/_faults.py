"""Scripted faults for FakeEngine: the queue ``inject_fault`` fills and the answer each fault gives.

Owns validating, matching and consuming scripted faults and turning one into a verbatim body (or no answer).
It does not log requests, route or speak HTTP, and holds no lock of its own: the engine's lock guards it.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody

#: The kinds accepted by ``FakeEngine.inject_fault``.
FAULT_KINDS = frozenset({"refuse", "drop", "hang", "status", "503"})
#: The kinds accepted by ``FakeEngine.inject_prompt_fault``: what one marked prompt does to the request holding it.
PROMPT_FAULT_KINDS = frozenset({"500", "nan", "echo", "swap"})


@dataclass(frozen=True)
class PromptFault:
    """One prompt's fault: the prompts holding ``marker`` (a token id, or part of a text prompt) spoil ``kind``."""

    kind: str
    marker: int | str


def _marked(prompt: Any, marker: int | str) -> list[int]:
    """The positions of the prompts of a completion body's ``prompt`` field that hold ``marker``."""
    single = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    prompts = [prompt] if single else prompt if isinstance(prompt, list) else []
    if isinstance(marker, str):
        return [i for i, p in enumerate(prompts) if isinstance(p, str) and marker in p]
    return [i for i, p in enumerate(prompts) if isinstance(p, list) and marker in p]


class PromptSpoiler:
    """What the prompt faults do to one completion request (built under the engine lock, applied outside it)."""

    def __init__(self, faults: list[PromptFault], prompt: Any):
        self._marked = [(fault.kind, _marked(prompt, fault.marker)) for fault in faults]
        self._marked = [(kind, positions) for kind, positions in self._marked if positions]

    def refusal(self, old_shape: bool) -> VllmBody | None:
        """The 500 a marked prompt fails its whole request with, or None."""
        if any(kind == "500" for kind, _ in self._marked):
            return bodies.error(500, "scripted failure of one prompt", _error_type(500), old_shape=old_shape)
        return None

    def spoil(self, choices: list[dict[str, Any]], n: int) -> None:
        """Spoil the marked prompts' choices (``n`` per prompt): a NaN logprob, a wrong echo, or swapped with the
        next prompt's (with no prompt token ids echoed anywhere, so only the index is left to match them by)."""
        count = len(choices) // n
        for kind, positions in self._marked:
            for position in positions:
                own = choices[position * n : (position + 1) * n]
                if kind == "nan" and isinstance(own[0].get("logprobs"), dict):
                    own[0]["logprobs"]["token_logprobs"][0] = float("nan")
                elif kind == "echo":
                    for choice in own:
                        choice["prompt_token_ids"] = [*(choice.get("prompt_token_ids") or []), 0]
                elif kind == "swap" and count > 1:
                    _swap(choices, n, position, (position + 1) % count)


def _swap(choices: list[dict[str, Any]], n: int, one: int, other: int) -> None:
    """Swap the choices of two prompts (each keeps its indices) and drop every echo of the prompt token ids."""
    for offset in range(n):
        a, b = choices[one * n + offset], choices[other * n + offset]
        a_index, b_index = a["index"], b["index"]
        a_copy = dict(a)
        a.clear()
        a.update(b, index=a_index)
        b.clear()
        b.update(a_copy, index=b_index)
    for choice in choices:
        choice.pop("prompt_token_ids", None)


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
        self.prompt_faults: list[PromptFault] = []

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
        self.prompt_faults.clear()

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
