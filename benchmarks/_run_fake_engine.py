"""Run ``lora_sampler.testing.FakeEngine`` in its own process, controlled over JSON lines on stdin/stdout.

The benchmarks start it through ``_common.ServerProcess``, so the engine's threads never share the client's GIL::

    python benchmarks/_run_fake_engine.py --lora-dir DIR [--model bench/base-model] [--latency 0]
        [--load-latency 0] [--slots N --swap-latency S] [--request-overhead 0]

It prints ``{"url": ..., "pid": ..., "model": ...}`` once it listens, then answers one JSON line per command line:

* ``{"op": "write_adapter", "name": N}``: write a minimal valid adapter into ``DIR/N``;
* ``{"op": "delay", "name": N, "seconds": S}``: ``set_visibility_delay(N, seconds=S)``;
* ``{"op": "stats", "name": N}``: completions and loads the engine logged for ``N``, by status;
* ``{"op": "reset"}``: clear the request log;
* ``{"op": "log"}``: every completion as ``[model, started, finished, status]`` (monotonic seconds), the adapter
  swaps into slots, and the adapters still registered.

It stops on end of input, SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socketserver
import sys
from typing import Any, Dict, List, Optional

import _common  # (also puts the checkout's lora_sampler on sys.path)

from lora_sampler.testing import FakeEngine, write_adapter

COMPLETIONS_PATH = "/v1/completions"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"


def stats(engine: FakeEngine, name: str) -> Dict[str, Any]:
    """Count the completions and loads the engine logged for ``name``, by status."""
    by_path: Dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for record in engine.requests:
        if record.model == name:
            by_path[record.path][record.status] += 1
    completions, loads = by_path[COMPLETIONS_PATH], by_path[LOAD_ADAPTER_PATH]
    return {
        "completions": sum(completions.values()),
        "completion_statuses": {str(k): v for k, v in sorted(completions.items())},
        "loads": sum(loads.values()),
        "load_statuses": {str(k): v for k, v in sorted(loads.items())},
        "max_loads_in_flight": engine.max_loads_in_flight_for(name),
    }


def handle(engine: FakeEngine, lora_dir: str, command: Dict[str, Any]) -> Dict[str, Any]:
    """Carry out one command and return its answer."""
    op = command.get("op")
    if op == "write_adapter":
        write_adapter(os.path.join(lora_dir, command["name"]), engine.model)
        return {"ok": True}
    if op == "delay":
        engine.set_visibility_delay(command["name"], seconds=float(command["seconds"]))
        return {"ok": True}
    if op == "stats":
        return stats(engine, command["name"])
    if op == "reset":
        engine.reset_log()
        return {"ok": True}
    if op == "log":
        completions = [
            [r.model, r.started, r.finished, r.status] for r in engine.requests if r.path == COMPLETIONS_PATH
        ]
        return {"completions": completions, "swaps": engine.adapter_swaps, "loaded": engine.loaded_adapters}
    return {"error": f"unknown op {op!r}"}


def main(argv: Optional[List[str]] = None) -> int:
    """Start the engine, print its URL line, and serve commands until end of input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-dir", required=True, help="the resolver directory")
    parser.add_argument("--model", default="bench/base-model", help="the base model name")
    parser.add_argument("--latency", type=float, default=0.0, help="service seconds per completion (default 0)")
    parser.add_argument("--load-latency", type=float, default=0.0, help="seconds per adapter load (default 0)")
    parser.add_argument("--slots", type=int, help="adapter slots of a running batch (default: no limit)")
    parser.add_argument("--swap-latency", type=float, default=0.0, help="seconds per swap into a slot (default 0)")
    parser.add_argument(
        "--request-overhead", type=float, default=0.0, help="seconds per request, one request at a time (default 0)"
    )
    parser.add_argument("--backlog", type=int, help="listen backlog of the engine's server (default: socketserver's 5)")
    args = parser.parse_args(argv)
    if args.backlog:
        # The stdlib servers' class attribute (FakeEngine's server derives from TCPServer), read at listen().
        socketserver.TCPServer.request_queue_size = args.backlog
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    settings: Dict[str, Any] = {"latency": args.latency, "load_latency": args.load_latency, "max_loras": 1024}
    settings.update(lora_slots=args.slots, swap_latency=args.swap_latency, request_overhead=args.request_overhead)
    with FakeEngine(model=args.model, lora_dir=args.lora_dir, **settings) as engine:
        print(json.dumps({"url": engine.url, "pid": os.getpid(), "model": engine.model}), flush=True)
        _common.serve_commands(lambda command: handle(engine, args.lora_dir, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
