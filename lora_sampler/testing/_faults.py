"""Scripted faults for FakeEngine: the faults ``inject_fault`` and ``inject_prompt_fault`` script, which request
each one matches, and what it does to the answer (a verbatim body, no answer, or spoiled choices).

It does not log requests, route or speak HTTP, and holds no lock of its own: the engine's lock guards the lists it
is handed. Stdlib only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody
from lora_sampler.testing._sampling import CompletionRequest

#: The kinds accepted by ``FakeEngine.inject_fault``.
FAULT_KINDS = frozenset({"refuse", "drop", "hang", "status", "503"})
#: The kinds accepted by ``FakeEngine.inject_prompt_fault``: what one marked prompt does to the request holding it.
PROMPT_FAULT_KINDS = frozenset({"500", "nan", "echo", "swap"})


@dataclass
class Fault:
    """One ``inject_fault``: the next ``remaining`` requests on ``path`` (for ``model``; None: any) fail as ``kind``.

    Raises:
        ValueError: an unknown kind, or a count below 1.
    """

    kind: str
    model: str | None
    path: str
    remaining: int
    status: int
    seconds: float
    message: str | None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {sorted(FAULT_KINDS)}, not {self.kind!r}")
        if self.remaining < 1:
            raise ValueError("count must be at least 1")

    def answer(self, wake: threading.Event) -> VllmBody | None:
        """The body this fault answers with; None for refuse, drop and hang (after ``seconds``, unless ``wake``
        is set first: the engine stopped or died)."""
        if self.kind == "status":
            return bodies.status_error(self.status, self.message or f"scripted {self.status}")
        if self.kind == "503":
            return bodies.retry_later()
        if self.kind == "hang":
            wake.wait(self.seconds)
        return None  # refuse, drop, hang: no answer


def take(faults: list[Fault], path: str, model: str | None) -> Fault | None:
    """Consume one use of the first fault matching ``path`` and ``model``; returns it, or None."""
    for fault in faults:
        if fault.path == path and (fault.model is None or fault.model == model):
            fault.remaining -= 1
            if not fault.remaining:
                faults.remove(fault)
            return fault
    return None


def prompt_fault(kind: str, marker: int | str) -> tuple[str, int | str]:
    """Check ``inject_prompt_fault``'s arguments and return the fault.

    Raises:
        ValueError: an unknown kind, or a marker that is neither an int nor a non-empty str.
    """
    if kind not in PROMPT_FAULT_KINDS:
        raise ValueError(f"kind must be one of {sorted(PROMPT_FAULT_KINDS)}, not {kind!r}")
    if isinstance(marker, bool) or not isinstance(marker, (int, str)) or marker == "":
        raise ValueError(f"marker must be a token id (int) or a non-empty str, not {marker!r}")
    return kind, marker


class PromptSpoiler:
    """What the prompt faults do to one completion request (built under the engine lock, applied outside it)."""

    def __init__(self, faults: list[tuple[str, int | str]], request: CompletionRequest):
        def marked(marker: int | str) -> list[int]:  # the positions of the prompts holding marker
            if isinstance(marker, str):
                return [i for i, text in enumerate(request.texts or ()) if marker in text]
            return [] if request.texts is not None else [i for i, p in enumerate(request.prompts) if marker in p]

        self._marked = [(kind, marked(marker)) for kind, marker in faults]
        self._marked = [(kind, positions) for kind, positions in self._marked if positions]

    def refusal(self) -> VllmBody | None:
        """The 500 a marked prompt fails its whole request with, or None."""
        if any(kind == "500" for kind, _ in self._marked):
            return bodies.status_error(500, "scripted failure of one prompt")
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
    """Swap the choices of two prompts (each place keeps its index) and drop every echo of the prompt token ids."""
    for offset in range(n):
        a, b = one * n + offset, other * n + offset
        choices[a], choices[b] = dict(choices[b], index=choices[a]["index"]), dict(
            choices[a], index=choices[b]["index"]
        )
    for choice in choices:
        choice.pop("prompt_token_ids", None)
