"""Everyday use as a notebook or script meets it: Ctrl-C in sample_many, re-run client cells, and result reprs.

A ``FakeEngine`` runs in this process; the client runs in a child process that imports the lora_sampler of
``--checkout`` (default: this one), so an older checkout is measured the same way::

    python benchmarks/bench_everyday.py [--checkout /path/to/other/checkout] [--label before]

* interrupt: 4 workers, completions that hang (60 s) after 0.4 s, SIGINT at 0.8 s: seconds until ``sample_many``
  returns control, the engine's requests still in flight 0.5 s later, and the answers reachable afterwards;
* the same inside ``with SamplerClient(...)`` (completions hanging 5 s): seconds until the block is left;
* re-runs: ``client = SamplerClient(...); client.sample_many(16 requests)`` ten times with the cyclic garbage
  collector off (as a notebook cell re-run): the child's threads and sockets afterwards;
* repr: characters of ``repr`` of one 4 x 16-token ``SampleOutput`` and of a list of 2,000.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict

import _common  # (also puts the checkout's lora_sampler on sys.path)

from lora_sampler.testing import FakeEngine

CHILD = r"""
import gc, json, os, signal, sys, threading, time
import lora_sampler
from lora_sampler import SamplerClient
url, model, what = sys.argv[1], sys.argv[2], sys.argv[3]

def sockets():
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))

if what == "interrupt":
    client = SamplerClient(url, max_workers=4)
    threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    results = None
    try:
        results = client.sample_many([{"prompt": f"p{i}", "base_model": model} for i in range(300)])
    except KeyboardInterrupt as stop:
        seconds = time.monotonic() - started - 0.8
        kept = getattr(stop, "results", None)
        reachable = sum(r is not None for r in kept) if kept is not None else 0
    print(json.dumps({"seconds_to_control": round(seconds, 3), "answers_reachable": reachable}), flush=True)
    time.sleep(1.5)
    os._exit(0)
if what == "interrupt_in_with":
    threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        with SamplerClient(url, max_workers=4) as client:
            client.sample_many([{"prompt": f"p{i}", "base_model": model} for i in range(300)])
    except KeyboardInterrupt:
        seconds = time.monotonic() - started - 0.8
    print(json.dumps({"seconds_to_leave_the_with_block": round(seconds, 3)}), flush=True)
    os._exit(0)
if what == "reruns":
    gc.disable()
    base_threads, base_sockets = threading.active_count(), sockets()
    for _ in range(10):
        client = SamplerClient(url, max_workers=8)
        client.sample_many([{"prompt": "p", "base_model": model}] * 16)
    time.sleep(0.5)
    print(json.dumps({"threads": threading.active_count() - base_threads, "sockets": sockets() - base_sockets}))
if what == "repr":
    from lora_sampler import GeneratedSequence, SampleOutput
    seq = GeneratedSequence(tuple(range(16)), tuple(-0.123456789012345 * (i + 1) for i in range(16)), "length",
                            "Once upon a time, there was")
    out = SampleOutput((seq,) * 4, model="step-400-37ccd49fc74a", body={})
    print(json.dumps({"one_output": len(repr(out)), "list_of_2000": len(repr([out] * 2000))}))
"""


def _child(checkout: str, engine: FakeEngine, what: str, cwd: str) -> Dict[str, Any]:
    env = _common.checkout_env(checkout)
    done = subprocess.Popen(
        [sys.executable, "-S", "-c", CHILD, engine.url, engine.model, what],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    assert done.stdout is not None
    line = done.stdout.readline()
    figures: Dict[str, Any] = json.loads(line)
    if what.startswith("interrupt"):
        threading.Event().wait(0.5)
        figures["engine_in_flight_0_5_s_later"] = engine.requests_in_flight
    done.wait(timeout=120)
    return figures


def measure(checkout: str) -> Dict[str, Any]:
    """Run the three measurements once against fresh engines."""
    result: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        with FakeEngine(latency=0.05) as engine:
            timer = threading.Timer(0.4 + 0.3, setattr, (engine, "latency", 60.0))  # the child needs ~0.3 s to start
            timer.start()
            result["interrupt"] = _child(checkout, engine, "interrupt", work)
            timer.cancel()
        with FakeEngine(latency=0.05) as engine:  # hangs of 5 s here: the old code waited them out in __exit__
            timer = threading.Timer(0.4 + 0.3, setattr, (engine, "latency", 5.0))
            timer.start()
            result["interrupt_in_with"] = _child(checkout, engine, "interrupt_in_with", work)
            timer.cancel()
        with FakeEngine() as engine:
            result["reruns"] = _child(checkout, engine, "reruns", work)
            result["repr"] = _child(checkout, engine, "repr", work)
    return result


def main() -> None:
    _common.checkout_run("bench_everyday", measure, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
