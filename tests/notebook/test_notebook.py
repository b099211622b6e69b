"""lora_sampler in a real IPython kernel, driven by nbclient as Jupyter drives it (tox -e notebook).

The kernel is its own process (jupyter_client starts it in a new session, so its own process group) and is always
shut down, its group killed if it lingers. The FakeEngine runs in this test process, on loopback, so what the engine
sees (requests in flight, aborted requests) and what the kernel holds (threads, connections) are measured apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, List

import pytest
from _services import require
from _waits import wait_until

from lora_sampler.testing import FakeEngine

nbformat = require("nbformat", "tox -e notebook installs nbclient, ipykernel and nbformat")
nbclient = require("nbclient", "tox -e notebook installs nbclient, ipykernel and nbformat")

pytestmark = pytest.mark.notebook

#: Seconds a hung completion takes here: a cell that waited for one could not end before this.
HANG_SECONDS = 60.0
#: Well under a hung completion: the cell ended, and the engine let go of every request, without waiting for them.
#: (How soon it really is, under a second, is measured by benchmarks/bench_everyday.py, not asserted here.)
STOP_SECONDS = HANG_SECONDS / 6


class Kernel:
    """One started kernel: run cells in it, read their outputs, interrupt it."""

    def __init__(self, client: Any):
        self.client = client
        self.notebook = client.nb
        self.pid = 0

    def run(self, source: str) -> Any:
        """Execute one cell; return it (outputs included). Errors are recorded in the cell, not raised."""
        cell = nbformat.v4.new_code_cell(source)
        self.notebook.cells.append(cell)
        self.client.execute_cell(cell, len(self.notebook.cells) - 1)
        return cell

    def value(self, source: str) -> Any:
        """Run ``print(json.dumps(<source>))`` and return the decoded value."""
        cell = self.run(f"import json as _json\nprint(_json.dumps({source}))")
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        assert text, cell.outputs
        return json.loads(text.strip().splitlines()[-1])

    def interrupt_when(self, ready: Callable[[], None], sent: List[float], failures: List[BaseException]) -> None:
        """SIGINT the kernel's process group, as Jupyter's interrupt does, once ``ready()`` returns (from a thread).

        Args:
            ready: Blocks until the cell is where the interrupt should find it, with its own deadline.
            sent: Gets the ``time.monotonic()`` at which the interrupt was sent.
            failures: Gets what ``ready`` raised (the interrupt is sent even so, and the cell ends).
        """
        group = os.getpgid(self.pid)

        def interrupt() -> None:
            try:
                ready()
            except Exception as error:  # reported by the test after the cell
                failures.append(error)
            sent.append(time.monotonic())
            os.killpg(group, signal.SIGINT)

        threading.Thread(target=interrupt, name="test-kernel-interrupt", daemon=True).start()


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    """A started IPython kernel in its own process group; shut down afterwards, its group killed if still there."""
    client = nbclient.NotebookClient(
        nbformat.v4.new_notebook(), kernel_name="python3", timeout=60, allow_errors=True, startup_timeout=60
    )
    with client.setup_kernel():
        kernel = Kernel(client)
        kernel.pid = kernel.value("__import__('os').getpid()")
        assert os.getpgid(kernel.pid) != os.getpgid(0)  # its own group: our SIGINT never reaches pytest
        try:
            yield kernel
        finally:
            pgid = os.getpgid(kernel.pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(kernel.pid):
        time.sleep(0.05)
    if _alive(kernel.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(") ", 1)[1][0] != "Z"


def established(pid: int, port: int) -> int:
    """TCP connections of process ``pid`` to 127.0.0.1:``port`` that are still established."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    count = 0
    with open(f"/proc/{pid}/net/tcp") as handle:
        for row in handle.read().splitlines()[1:]:
            fields = row.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if inode in inodes and state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as engine:
        yield engine


def _client_cell(engine: FakeEngine, workers: int = 4) -> str:
    return f"from lora_sampler import SamplerClient\nclient = SamplerClient({engine.url!r}, max_workers={workers})"


def test_notebook_progress_bar_is_one_output(kernel: Kernel, engine: FakeEngine) -> None:
    """sample_many(progress=True) over 2,000 requests leaves one output: the widget, with the totals and retries."""
    kernel.run(_client_cell(engine, 16))
    cell = kernel.run(
        f"outs = client.sample_many([{{'prompt': 'p', 'base_model': {engine.model!r}, 'max_tokens': 2}}] * 2000, "
        "progress=True)"
    )
    assert [o.output_type for o in cell.outputs] == ["display_data"], cell.outputs
    assert "application/vnd.jupyter.widget-view+json" in cell.outputs[0]["data"]
    assert kernel.value("len(outs)") == 2000


def test_notebook_interrupt_stops_the_cell_and_keeps_the_answers(kernel: Kernel, engine: FakeEngine) -> None:
    """A kernel interrupt during sample_many against a hung engine: the cell ends without waiting for it, the engine
    aborts what was in flight, no connection stays open, and the answers received are in client.last_interrupt.

    The engine answers the first 20 completions and holds the rest (hung until the client hangs up); the kernel is
    interrupted once its four workers wait on held ones: mid-run whatever the machine's speed (a timed interrupt
    found the cell done, or not yet hung)."""
    kernel.run(_client_cell(engine, 4))
    engine.hold(after=20)
    sent: List[float] = []
    failures: List[BaseException] = []
    kernel.interrupt_when(lambda: engine.wait_for_held(4, timeout=HANG_SECONDS), sent, failures)
    # One prompt a request: 500 requests, 20 answered before the hold (at the default 32 prompts a request the cell
    # was done in 0.2 s, before a timed interrupt). test_interrupts.py interrupts batches.
    many = f"[{{'prompt': 'p', 'base_model': {engine.model!r}}}] * 500"
    cell = kernel.run(f"outs = client.sample_many({many}, prompts_per_request=1)")
    ended = time.monotonic()
    assert not failures, failures
    errors: List[Any] = [o for o in cell.outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["SamplingInterruptedError"], cell.outputs
    assert ended - sent[0] < STOP_SECONDS
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline and (engine.requests_in_flight or established(kernel.pid, engine.port)):
        time.sleep(0.02)
    assert engine.requests_in_flight == 0 and engine.aborted_requests >= 1
    assert established(kernel.pid, engine.port) == 0
    done, slots = kernel.value("[client.last_interrupt.done, len(client.last_interrupt.results)]")
    assert 4 <= done < slots <= 500


def test_notebook_rerunning_a_client_cell_keeps_threads_flat(kernel: Kernel, engine: FakeEngine) -> None:
    """Ten runs of a cell that makes a client and samples (never closed) leave the threads of one client at most: its
    8 workers and the process's deadline watchdog. (How many workers one run starts varies with how its 32 prompts
    were grouped, 3 to 8, so the bound is one client's, not the first run's count.)"""
    workers = 8
    cell = (
        _client_cell(engine, workers)
        + f"\n_ = client.sample_many([{{'prompt': 'p', 'base_model': {engine.model!r}}}] * 32)"
    )
    before = kernel.value("__import__('threading').active_count()")
    for _ in range(10):
        kernel.run(cell)
    bound = before + workers + 1  # the threads of the clients dropped may still be on their way out: waited for
    wait_until(lambda: kernel.value("__import__('threading').active_count()") <= bound, f"{bound} threads at most")
    assert kernel.value("__import__('threading').active_count()") <= before + workers + 1
    assert established(kernel.pid, engine.port) <= workers
