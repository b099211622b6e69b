"""One FakeEngine replica in a process of its own, so a router test can kill it like a crashed vLLM server.

    python tests/router/_replica.py --lora-dir DIR [--port 0] [--latency 0.0] [--load-latency 0.0] [--api-key-env NAME]

Prints one JSON line ``{"url": "http://127.0.0.1:PORT", "pid": PID}`` once it listens. Then it reads JSON command
lines on its standard input and answers each with one JSON line (``{"ok": ...}`` or ``{"error": "..."}``):

- ``{"op": "delay", "name": N, "requests": K}`` or ``"seconds": S``: ``FakeEngine.set_visibility_delay``;
- ``{"op": "fault", "kind": ..., "count": ..., ...}``: ``FakeEngine.inject_fault``;
- ``{"op": "requests"}``: the request log, as a list of ``RequestRecord`` dicts;
- ``{"op": "max_loads", "name": N}``: ``FakeEngine.max_loads_in_flight_for(N)``;
- ``{"op": "loaded"}``: the registered adapter names;
- ``{"op": "reset"}``: ``FakeEngine.reset_log``.

It serves until SIGTERM/SIGINT or until its standard input closes, so it never outlives the test that started it.
The API key, when any, is read from the environment variable named by ``--api-key-env`` (never from argv).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict

from lora_sampler.testing import FakeEngine


def _commands(engine: FakeEngine) -> Dict[str, Callable[[Dict[str, Any]], Any]]:
    def delay(cmd: Dict[str, Any]) -> Any:
        engine.set_visibility_delay(cmd["name"], seconds=cmd.get("seconds"), requests=cmd.get("requests"))
        return True

    def fault(cmd: Dict[str, Any]) -> Any:
        kwargs = {k: v for k, v in cmd.items() if k not in ("op", "kind")}
        engine.inject_fault(cmd["kind"], **kwargs)
        return True

    def reset(cmd: Dict[str, Any]) -> Any:
        engine.reset_log()
        return True

    return {
        "delay": delay,
        "fault": fault,
        "requests": lambda cmd: [dataclasses.asdict(r) for r in engine.requests],
        "max_loads": lambda cmd: engine.max_loads_in_flight_for(cmd["name"]),
        "loaded": lambda cmd: engine.loaded_adapters,
        "reset": reset,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lora-dir", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--load-latency", type=float, default=0.0)
    parser.add_argument("--model", default="tiny-base")
    parser.add_argument("--api-key-env", default=None, help="read the engine's API key from this variable")
    args = parser.parse_args()
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    engine = FakeEngine(
        model=args.model,
        lora_dir=args.lora_dir,
        latency=args.latency,
        load_latency=args.load_latency,
        port=args.port,
        api_key=api_key,
    ).start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    commands = _commands(engine)

    def serve_commands() -> None:
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                answer: Dict[str, Any] = {"ok": commands[cmd["op"]](cmd)}
            except Exception as exc:  # one bad command must not end the replica
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        stop.set()  # stdin closed: the test is gone

    threading.Thread(target=serve_commands, daemon=True).start()
    print(json.dumps({"url": engine.url, "pid": os.getpid()}), flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
