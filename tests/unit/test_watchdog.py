"""The deadline watchdog as a state machine: exchanges armed, sent and disarmed in any order.

Its promises: an exchange is never cut before its deadline, never after it was disarmed, and always once its
deadline passed while it was armed. The sockets are stand-ins that record when they were shut down.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from _waits import DEADLINE, wait_until
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_sampler._transport.connections import CUT_DEADLINE, Slot, Watchdog, answer_deadline

#: How long the end of a run waits, at most, for the watchdog to cut what is due (a loaded machine is slow, not wrong).
SETTLE_SECONDS = DEADLINE
#: One watchdog (one thread) for every run of the machine, as a process has one.
WATCHDOG = Watchdog()


class RecordingSocket:
    """Stands in for a connection's socket: records each shutdown's monotonic time."""

    def __init__(self) -> None:
        self.shutdowns: List[float] = []

    def shutdown(self, how: int) -> None:
        self.shutdowns.append(time.monotonic())


class Connection:
    def __init__(self) -> None:
        self.sock = RecordingSocket()


class Exchange:
    """One slot's current exchange as the test sees it."""

    def __init__(self, slot: Slot, overall: float, read: float):
        self.slot, self.overall, self.read = slot, overall, read
        self.connection = Connection()
        self.disarmed_with: Optional[int] = None  # shutdowns seen when disarmed
        self.final_deadline: Optional[float] = None  # its deadline when disarmed: the slot may then serve another

    @property
    def deadline(self) -> float:
        if self.final_deadline is not None:
            return self.final_deadline
        return answer_deadline(self.slot, self.overall, self.read)


class WatchdogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.watchdog = WATCHDOG
        self.slots = [Slot() for _ in range(4)]
        self.exchanges: Dict[int, Exchange] = {}
        self.finished: List[Exchange] = []

    @rule(index=st.integers(0, 3), connect=st.floats(0.0, 0.03), read=st.floats(0.001, 0.04))
    def arm(self, index: int, connect: float, read: float) -> None:
        if index in self.exchanges:
            self.disarm(index)
        slot = self.slots[index]
        exchange = Exchange(slot, self.watchdog.arm(slot, connect, read), read)
        slot.attach(exchange.connection)  # type: ignore[arg-type]
        self.exchanges[index] = exchange

    @rule(index=st.integers(0, 3))
    def send(self, index: int) -> None:
        exchange = self.exchanges.get(index)
        if exchange is not None and not exchange.slot.sent and exchange.slot.cut is None:
            exchange.slot.sent = time.monotonic()

    @rule(index=st.integers(0, 3))
    def disarm(self, index: int) -> None:
        exchange = self.exchanges.pop(index, None)
        if exchange is None:
            return
        exchange.final_deadline = exchange.deadline  # before disarm ends the exchange (the slot may then serve another)
        self.watchdog.disarm(exchange.slot)
        exchange.disarmed_with = len(exchange.connection.sock.shutdowns)
        self.finished.append(exchange)

    @invariant()
    def never_early_nor_after_disarm(self) -> None:
        for exchange in [*self.exchanges.values(), *self.finished]:
            shutdowns = exchange.connection.sock.shutdowns
            assert len(shutdowns) <= 1
            assert all(when >= exchange.deadline for when in shutdowns), "cut before its deadline"
            if exchange.disarmed_with is not None:
                assert len(shutdowns) == exchange.disarmed_with, "cut after it was disarmed"

    def teardown(self) -> None:
        limit = time.monotonic() + SETTLE_SECONDS
        for exchange in self.exchanges.values():
            while not exchange.connection.sock.shutdowns and time.monotonic() < limit:
                time.sleep(0.005)
            assert exchange.connection.sock.shutdowns, "an armed exchange past its deadline was never cut"
            assert exchange.slot.cut == CUT_DEADLINE
        self.never_early_nor_after_disarm()


WatchdogMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
test_watchdog_state_machine = WatchdogMachine.TestCase


def test_a_finished_exchange_keeps_its_deadline_when_its_slot_is_used_again() -> None:
    """A slot cut at its read deadline (sent + read, before its overall deadline), then disarmed and armed again for
    a new exchange, is still judged by the deadline it had. The machine judged a finished exchange by its slot's new
    state (not sent: its overall deadline, later than the cut), so under load, when a step takes longer than the
    read timeout, a correct cut read as "cut before its deadline"."""
    machine = WatchdogMachine()
    machine.arm(0, connect=0.03, read=0.001)
    machine.send(0)
    first = machine.exchanges[0]
    wait_until(lambda: bool(first.connection.sock.shutdowns), "the sent exchange cut at its read deadline")
    machine.disarm(0)
    machine.arm(0, connect=0.03, read=0.04)  # the same slot, not sent yet
    machine.never_early_nor_after_disarm()
    machine.teardown()
