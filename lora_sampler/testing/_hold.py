"""FakeEngine's hold: completions kept in flight until a test releases them, or until enough are in flight together.

A test that interrupts, kills or overlaps needs the job to be mid-run, or the requests to overlap, whatever the
machine's speed: it holds completions (``FakeEngine.hold``), waits until one is held (``wait_for_held``), acts, and
releases them. ``Hold`` is a base class of FakeEngine, holding these public controls and their state. Stdlib only;
it shares the engine's lock and waits as its lifecycle does, so a held request still sees stop, death and its client
hanging up.
"""

from __future__ import annotations

from typing import Callable

from lora_sampler.testing._lifecycle import Lifecycle


class Hold:
    """Which completions are held now, and how many are waiting. Every method takes the engine's lock itself."""

    _lifecycle: Lifecycle

    def _init_hold(self) -> None:
        """Hold nothing (called by ``FakeEngine.__init__`` once its lifecycle is set)."""
        self._changed = self._lifecycle.changed  # notified when a hold is released or its overlap came
        self._holding = False
        self._hold_model: str | None = None
        self._hold_until: int | None = None
        self._hold_beside: str | None = None
        self._hold_after = 0  # completions the hold still lets through before it holds
        self._held = 0
        self._waves = 0  # times the held completions were let go at once (the overlap came, or a release kept holding)

    def hold(
        self,
        *,
        model: str | None = None,
        until_in_flight: int | None = None,
        beside: str | None = None,
        after: int = 0,
    ) -> None:
        """Hold completions (for ``model``; None: every one) in flight from now on, until ``release()``.

        A held completion has been read, checked and counted in flight (not yet logged); it is answered once released
        (then after ``latency``). So a test that interrupts or kills a job first sees it mid-run (``wait_for_held``),
        and one that needs requests to overlap gets the overlap whatever the machine's speed: with
        ``until_in_flight=N`` the held completions go on once N completions are in flight together, with
        ``beside=OTHER`` once a completion for model OTHER is in flight with them (and one arriving while OTHER's is
        in flight is not held). ``after=N`` lets the next N completions through first (a job that has written some
        answers). Stop, death and a client hanging up end a hold.

        Raises:
            ValueError: ``until_in_flight`` is below 2, ``beside`` is ``model``, or ``after`` is negative.
        """
        if not (isinstance(after, int) and after >= 0):
            raise ValueError(f"after must be a count of completions >= 0, got {after!r}")
        if until_in_flight is not None and until_in_flight < 2:
            raise ValueError(f"until_in_flight must be None or at least 2, got {until_in_flight!r}")
        if beside is not None and beside == model:
            raise ValueError(f"beside must be another model than the held one, got {beside!r} for both")
        with self._changed:
            self._holding, self._hold_model, self._hold_until, self._hold_beside = True, model, until_in_flight, beside
            self._hold_after = after

    def release(self, *, keep_holding: bool = False) -> None:
        """Let every held completion go on, and hold no more; with ``keep_holding``, completions arriving later are
        held as before (a test steps a job through its requests one at a time)."""
        with self._changed:
            if keep_holding:
                self._waves += 1  # the held ones see a new wave and go on; the hold stays on
            else:
                self._holding = False
            self._changed.notify_all()

    @property
    def held_requests(self) -> int:
        """Completions held now (``hold``)."""
        with self._changed:
            return self._held

    def wait_for_held(self, count: int = 1, timeout: float = 60.0) -> None:
        """Block until ``count`` completions are held at once: the job that sent them is mid-run.

        Raises:
            TimeoutError: fewer were held after ``timeout`` seconds (the message says how many).
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._held >= count, timeout):
                raise TimeoutError(f"{self._held} completions held after {timeout:g} s, waiting for {count}")

    def _wait_if_held(self, model: str, flying: Callable[[], list[str]]) -> None:
        """Keep a completion for ``model`` here while the hold applies to it; stop and death let it go on (to its
        503 or its end).

        Args:
            model: the completion's model.
            flying: the model of each completion in flight now, this one's too (called with the engine's lock held).

        Raises:
            ClientGone: the client hung up while the completion was held (vLLM aborts it).
        """
        with self._changed:
            if self._holding and self._overlap(flying()):
                self._waves += 1  # the overlap asked for happened: every held completion goes on, and this one
                self._changed.notify_all()
                return
            if not self._holds(model):
                return
            if self._hold_after:
                self._hold_after -= 1
                return
            self._held += 1
            wave = self._waves
            self._changed.notify_all()
            try:
                self._lifecycle.wait_until(lambda: not self._holds(model) or wave != self._waves)
            finally:
                self._held -= 1
                self._changed.notify_all()

    def _overlap(self, flying: list[str]) -> bool:
        """Whether the completions in flight are the overlap the hold waits for (``until_in_flight``, ``beside``)."""
        enough = self._hold_until is not None and len(flying) >= self._hold_until
        return enough or (self._hold_beside is not None and self._hold_beside in flying)

    def _holds(self, model: str) -> bool:
        return self._holding and self._hold_model in (None, model)
