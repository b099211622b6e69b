"""Run N ``FakeEngine`` replicas WITHOUT a resolver in one process of their own (one start-up for the whole fleet).

A replica without a resolver serves an adapter only once ``/v1/load_lora_adapter`` loaded it (SGLang, or vLLM
without the resolver plugin). ``bench_fleet.py`` starts this through ``_common.ServerProcess``::

    python benchmarks/_run_fake_fleet.py --replicas 16 [--model bench/base-model] [--load-latency 0.5]

It prints ``{"url": <first replica>, "urls": [...], "pid": ...}`` once every replica listens, then answers one JSON
line per command line:

* ``{"op": "loads", "name": N}``: per replica, ``{"loads": <load requests for N>, "served_at": <time.monotonic()
  when its first successful load of N answered, or null>}`` (CLOCK_MONOTONIC: the benchmark's clock too).

It stops on end of input, SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from typing import Any, Dict, List, Optional

import _common  # (also puts the checkout's lora_sampler on sys.path)

from lora_sampler.testing import FakeEngine

LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"


def loads(engine: FakeEngine, name: str) -> Dict[str, Any]:
    """Count the loads ``engine`` logged for ``name``, and when the first successful one answered."""
    records = [r for r in engine.requests if r.path == LOAD_ADAPTER_PATH and r.model == name]
    served = [r.finished for r in records if r.status == 200]
    return {"loads": len(records), "served_at": min(served) if served else None}


def main(argv: Optional[List[str]] = None) -> int:
    """Start the replicas, print their URL line, and serve commands until end of input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, required=True, help="how many FakeEngine replicas")
    parser.add_argument("--model", default="bench/base-model", help="the base model name")
    parser.add_argument("--load-latency", type=float, default=0.5, help="seconds per adapter load (default 0.5)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(FakeEngine(model=args.model, load_latency=args.load_latency, max_loras=64))
            for _ in range(args.replicas)
        ]
        urls = [engine.url for engine in engines]
        print(json.dumps({"url": urls[0], "urls": urls, "pid": os.getpid()}), flush=True)

        def handle(command: Dict[str, Any]) -> Dict[str, Any]:
            if command.get("op") != "loads":
                raise ValueError(f"unknown op {command.get('op')!r}")
            return {"replicas": [loads(engine, command["name"]) for engine in engines]}

        _common.serve_commands(handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
