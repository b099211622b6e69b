"""``TinkerFuture`` follows the client's future through every order of start, cancel, answer and failure."""

from __future__ import annotations

import concurrent.futures
from typing import Any, List

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


class FutureMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from lora_sampler.tinker import TinkerFuture

        self.inner: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.outer = TinkerFuture(self.inner, lambda value: [value])
        self.callbacks: List[Any] = []
        self.outer.add_done_callback(self.callbacks.append)
        self.started = False

    @precondition(lambda self: not self.inner.done() and not self.started)
    @rule()
    def start(self) -> None:
        assert self.inner.set_running_or_notify_cancel()
        self.started = True

    @rule()
    def cancel(self) -> None:
        could = self.inner.cancelled() or (not self.inner.done() and not self.started)  # as Future.cancel
        assert self.outer.cancel() == could

    @precondition(lambda self: not self.inner.done())
    @rule(value=st.integers())
    def answer(self, value: int) -> None:
        self.inner.set_result(value)

    @precondition(lambda self: not self.inner.done())
    @rule()
    def fail(self) -> None:
        self.inner.set_exception(ValueError("the engine said no"))

    @invariant()
    def follows_the_inner_future(self) -> None:
        assert self.outer.done() == self.inner.done()
        assert self.outer.cancelled() == self.inner.cancelled()
        assert len(self.callbacks) == int(self.outer.done())
        if self.inner.done() and not self.inner.cancelled():
            error = self.inner.exception()
            assert self.outer.exception() is error
            if error is None:
                assert self.outer.result() == [self.inner.result()]


def test_future_machine(tinker: Any) -> None:
    run = FutureMachine.TestCase
    run.settings = settings(max_examples=60, stateful_step_count=8, deadline=None)
    run("runTest").runTest()
