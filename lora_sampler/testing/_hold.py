"""FakeEngine's hold: completions kept in flight until a test releases them, or until enough are in flight together.

A test that interrupts, kills or overlaps needs the job to be mid-run, or the requests to overlap, whatever the
machine's speed: it holds completions (``FakeEngine.hold``), waits until one is held (``wait_for_held``), acts, and
releases them. Stdlib only; it shares the engine's lock and waits as its lifecycle does, so a held request still
sees stop, death and its client hanging up.
"""

from __future__ import annotations

from typing import Callable

from lora_sampler.testing._lifecycle import Lifecycle


class Hold:
    """Which completions are held now, and how many are waiting. Every method takes the engine's lock itself."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._changed = lifecycle.changed
        self._on = False
        self._model: str | None = None
        self._until: int | None = None
        self._beside: str | None = None
        self._after = 0  # completions the hold still lets through before it holds
        self._held = 0
        self._waves = 0  # times the held completions were let go at once (the overlap came, or a release kept holding)

    def hold(self, model: str | None, until_in_flight: int | None, beside: str | None, after: int) -> None:
        """Hold the completions for ``model`` (None: every one) from now on; see ``FakeEngine.hold``."""
        if not (isinstance(after, int) and after >= 0):
            raise ValueError(f"after must be a count of completions >= 0, got {after!r}")
        if until_in_flight is not None and until_in_flight < 2:
            raise ValueError(f"until_in_flight must be None or at least 2, got {until_in_flight!r}")
        if beside is not None and beside == model:
            raise ValueError(f"beside must be another model than the held one, got {beside!r} for both")
        with self._changed:
            self._on, self._model, self._until, self._beside = True, model, until_in_flight, beside
            self._after = after

    def release(self, keep_holding: bool) -> None:
        """Let every held completion go on; hold no more, or (``keep_holding``) hold the ones arriving later."""
        with self._changed:
            if keep_holding:
                self._waves += 1  # the held ones see a new wave and go on; the hold stays on
            else:
                self._on = False
            self._changed.notify_all()

    @property
    def held(self) -> int:
        """Completions held now."""
        with self._changed:
            return self._held

    def wait_for_held(self, count: int, timeout: float) -> None:
        """Block until ``count`` completions are held at once.

        Raises:
            TimeoutError: fewer were held after ``timeout`` seconds (the message says how many).
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._held >= count, timeout):
                raise TimeoutError(f"{self._held} completions held after {timeout:g} s, waiting for {count}")

    def wait(self, model: str, flying: Callable[[], list[str]]) -> None:
        """Keep a completion for ``model`` here while the hold applies to it; stop and death let it go on (to its
        503 or its end).

        Args:
            model: the completion's model.
            flying: the model of each completion in flight now, this one's too (called with the engine's lock held).

        Raises:
            ClientGone: the client hung up while the completion was held (vLLM aborts it).
        """
        with self._changed:
            if self._on and self._overlap(flying()):
                self._waves += 1  # the overlap asked for happened: every held completion goes on, and this one
                self._changed.notify_all()
                return
            if not self._applies(model):
                return
            if self._after:
                self._after -= 1
                return
            self._held += 1
            wave = self._waves
            self._changed.notify_all()
            try:
                self._lifecycle.wait_until(lambda: not self._applies(model) or wave != self._waves)
            finally:
                self._held -= 1
                self._changed.notify_all()

    def _overlap(self, flying: list[str]) -> bool:
        """Whether the completions in flight are the overlap the hold waits for (``until_in_flight``, ``beside``)."""
        enough = self._until is not None and len(flying) >= self._until
        return enough or (self._beside is not None and self._beside in flying)

    def _applies(self, model: str) -> bool:
        return self._on and self._model in (None, model)
