"""Scoring isolation: the rule (a scoring request never shares the engine with another model's request), the queue
of model groups (arrival order, no starvation), progress (nothing waits while nothing is in flight), and the
blocking wrapper (cancellation and Ctrl-C give the turn back)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Dict, Iterator, List, Tuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lora_sampler._client.isolation import Admissions, ModelIsolation, Ticket
from lora_sampler._transport.connections import CancelScope
from lora_sampler.errors import RequestCancelledError

MODELS = st.sampled_from(["base", "a", "b", "c"])


class IsolationMachine(RuleBasedStateMachine):
    """Requests arrive, finish and are cancelled in any order; the rule, progress and fairness always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.admissions = Admissions()
        self.flying: List[Ticket] = []
        self.waiting: List[Ticket] = []
        self.groups_ahead: Dict[Ticket, int] = {}

    def _admitted(self, tickets: List[Ticket]) -> None:
        for ticket in tickets:
            self.waiting.remove(ticket)
            self.flying.append(ticket)

    @rule(model=MODELS, scoring=st.booleans(), mixing=st.booleans())
    def arrive(self, model: str, scoring: bool, mixing: bool) -> None:
        ticket = Ticket(model, scoring, mixing)
        self.waiting.append(ticket)
        self.admissions.arrive(ticket)
        self._admitted([t for t in self.waiting if t.admitted])

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.flying))
        self.flying.remove(ticket)
        self._admitted(self.admissions.finish(ticket))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(ticket)
        self._admitted(self.admissions.withdraw(ticket))

    @invariant()
    def scoring_never_mixes(self) -> None:
        """Two requests of different models in flight: neither scores, or both belong to a call that mixes."""
        for ticket in self.flying:
            if ticket.scoring:
                for other in self.flying:
                    if other.model != ticket.model:
                        assert ticket.mixing and other.mixing, [(t.model, t.scoring, t.mixing) for t in self.flying]

    @invariant()
    def nothing_waits_on_nothing(self) -> None:
        if not self.flying:
            assert not self.waiting

    @invariant()
    def counts_match(self) -> None:
        flying: Dict[str, int] = {}
        for ticket in self.flying:
            flying[ticket.model] = flying.get(ticket.model, 0) + 1
        assert self.admissions.in_flight == flying
        queued = [t for group in self.admissions.groups.values() for t in group]
        assert sorted(map(id, queued)) == sorted(map(id, self.waiting))

    @invariant()
    def groups_ahead_never_grow(self) -> None:
        """No starvation: the model groups queued ahead of a waiting request only ever shrink."""
        order = list(self.admissions.groups)
        for ticket in self.waiting:
            ahead = order.index(ticket.model)
            assert ahead <= self.groups_ahead.get(ticket, ahead)
            self.groups_ahead[ticket] = ahead


TestIsolationMachine = IsolationMachine.TestCase
TestIsolationMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_admissions_sampling_keeps_its_overlap() -> None:
    """Requests without prompt logprobs for many models are all in flight at once: nothing waits."""
    admissions = Admissions()
    assert all(admissions.arrive(Ticket(model, False)) for model in ["a", "b", "base", "a"])


def test_admissions_scoring_waits_for_other_models_then_goes_in_arrival_order() -> None:
    """A scoring request waits for other models to drain; later requests of other models wait behind it."""
    admissions = Admissions()
    sampling_b = Ticket("b", False)
    assert admissions.arrive(sampling_b)
    score_a, later_b, more_a = Ticket("a", True), Ticket("b", False), Ticket("a", True)
    assert not admissions.arrive(score_a)
    assert not admissions.arrive(later_b)  # b's overlap would starve a: it queues behind
    assert not admissions.arrive(more_a)  # joins a's group, ahead of b's
    assert admissions.finish(sampling_b) == [score_a, more_a]
    assert admissions.finish(score_a) == [] and admissions.finish(more_a) == [later_b]


def test_model_isolation_waiting_request_honours_cancellation() -> None:
    """A request waiting its turn whose fan-out is cancelled raises and leaves no trace in the queue."""
    isolation = ModelIsolation()
    scope = CancelScope()
    outcome: List[BaseException] = []

    def admit_b(_: object) -> None:
        with isolation.admit("b", False):
            pass

    def waiter() -> None:
        try:
            scope.run(admit_b, None)
        except RequestCancelledError as error:
            outcome.append(error)

    with isolation.admit("a", True):
        thread = threading.Thread(target=waiter)
        thread.start()
        while not isolation.waits:
            threading.Event().wait(0.01)
        scope.cancel()
        thread.join(5)
        assert not thread.is_alive() and len(outcome) == 1
    assert not isolation._admissions.groups and not isolation._admissions.in_flight


def test_model_isolation_mix_adapters_keeps_nothing_apart() -> None:
    """With mix_adapters (or inside mixing()), a scoring request and another model's request are in flight together."""
    for isolation in (ModelIsolation(mix_adapters=True), ModelIsolation()):
        with isolation.mixing() if isolation.active else isolation.admit("x", False):
            with isolation.admit("a", True), isolation.admit("b", False):
                assert isolation.waits == 0


def test_model_isolation_wakes_the_next_group_when_a_scoring_request_ends() -> None:
    """The waiting request of another model starts once the scoring request in flight ends."""
    isolation = ModelIsolation()
    started = threading.Event()

    def other() -> None:
        with isolation.admit("b", False):
            started.set()

    with isolation.admit("a", True):
        thread = threading.Thread(target=other)
        thread.start()
        assert not started.wait(0.2)
    assert started.wait(5)
    thread.join(5)


@pytest.mark.parametrize("scoring", [True, False])
def test_model_isolation_ctrl_c_while_waiting_gives_the_turn_back(scoring: bool) -> None:
    """Ctrl-C in a request waiting its turn raises at once and removes it from the queue."""
    isolation = ModelIsolation()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with isolation.admit("a", True):
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(5)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            with isolation.admit("b", scoring):
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
        thread.join(5)
    assert isolation.waits == 1 and not isolation._admissions.groups and not isolation._admissions.in_flight


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_model_isolation_forked_child_does_not_wait_for_the_parents_requests() -> None:
    """A child forked while a scoring request of the parent is in flight sends another model's request at once."""
    isolation = ModelIsolation()
    with isolation.admit("a", True):
        pid = os.fork()
        if pid == 0:  # the child: the parent's request is not in flight here
            code = 1
            try:
                with isolation.admit("b", False):
                    code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited for its parent's scoring request")
    assert os.waitstatus_to_exitcode(status) == 0


@contextlib.contextmanager
def request(isolation: ModelIsolation, model: str, scoring: bool, mixing: bool) -> Iterator[None]:
    """One request's turn, of a call that mixes (inside ``mixing()``) or not."""
    with isolation.mixing() if mixing else contextlib.nullcontext(), isolation.admit(model, scoring):
        yield


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # Another caller's scoring waits for the mixing call's request of another model: it went straight in while
        # any mixing() block was open (169 of 800 wrong scores beside check_scoring(concurrent=True)).
        (("b", True, True), ("a", True, False)),
        # The mixing call waits its turn: its request is not sent beside another caller's scoring.
        (("a", True, False), ("b", False, True)),
    ],
)
def test_model_isolation_mixing_exempts_only_its_own_calls_requests(
    first: Tuple[str, bool, bool], second: Tuple[str, bool, bool]
) -> None:
    """One call's mixing() lets only its own requests mix: the rule holds between it and every other caller."""
    isolation = ModelIsolation()
    holding, release, entered = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with request(isolation, *first):
            holding.set()
            release.wait(10)

    def then() -> None:
        with request(isolation, *second):
            entered.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)  # the first request is in flight: the overlap is forced from here
    waiter = threading.Thread(target=then)
    waiter.start()
    deadline = time.monotonic() + 10
    while not isolation.waits and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert isolation.waits == 1 and not entered.is_set()
    finally:
        release.set()
        holder.join(5)
    assert entered.wait(5)
    waiter.join(5)
    assert isolation.active  # the block is closed, and it was never open in this thread
