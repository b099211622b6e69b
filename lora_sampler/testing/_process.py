"""A ``FakeEngine`` in a process of its own, so a test can kill it like a crashed vLLM server and start it again.

The parent side is ``EngineProcess``; the child is ``python -m lora_sampler.testing`` (``_serve``) with its settings
as flags, ``--commands`` among them. The child prints its URL as its first stdout line once it listens. Then it reads
JSON command lines on its standard input and answers each with one JSON line (``{"ok": ...}`` or ``{"error": "..."}``):

- ``{"op": "delay", "name": N, "requests": K}`` or ``"seconds": S``: ``FakeEngine.set_visibility_delay``;
- ``{"op": "fault", "kind": ..., "count": ..., ...}``: ``FakeEngine.inject_fault``;
- ``{"op": "requests"}``: the request log, as a list of ``RequestRecord`` dicts;
- ``{"op": "max_loads", "name": N}``: ``FakeEngine.max_loads_in_flight_for(N)``;
- ``{"op": "loaded"}``: the registered adapter names;
- ``{"op": "reset"}``: ``FakeEngine.reset_log``;
- ``{"op": "runtime", "on": bool}``: ``FakeEngine.set_runtime_lora_updating``;
- ``{"op": "slow_unload", "seconds": S}``: every later ``/v1/unload_lora_adapter`` answers after S seconds
  (``FakeEngine.unload_latency``);
- ``{"op": "hold", ...}``, ``{"op": "release"}``, ``{"op": "wait_for_held", "count": N, "timeout": S}``:
  ``FakeEngine.hold`` (its keyword arguments), ``release`` and ``wait_for_held``.

It serves until SIGTERM/SIGINT or until its standard input closes, so it never outlives the test that started it.
``hidden`` (``--hide NAME=K``) hides ``lora_dir/NAME`` for its first K completions from the start (a restarted engine
that has forgotten an adapter and sees it late). Stdlib only; loopback only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Dict, List, Optional

from lora_sampler.testing._engine import FakeEngine

#: Seconds a child gets to print its URL line.
START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL when a process group is stopped.
STOP_GRACE = 5.0


def stop_group(process: subprocess.Popen[Any], grace: float = STOP_GRACE) -> None:
    """Stop a process and its whole group (started with ``start_new_session``): SIGTERM, wait, SIGKILL. Idempotent."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group, if any


class EngineProcess:
    """A FakeEngine in its own process group, driven by JSON command lines on its standard input.

    Use it as a context manager (or call ``stop``): the group is always stopped. ``kill`` is a crash (SIGKILL);
    ``restart`` starts a fresh engine on the same port (same URL, empty adapter table), as a redeployed server.

    Args:
        lora_dir: The engine's resolver directory.
        port: Where to listen (0 picks a free port).
        model: The base model name.
        env: Extra environment variables for the child.
        hidden: Adapter names hidden from the resolver for their first K completions, set before it listens.
        resolver: False serves without the filesystem resolver (adapters only once loaded; ``lora_dir`` unread).
        settings: More ``FakeEngine`` settings the child takes as flags (``_serve.ENGINE_FLAGS``: ``latency``,
            ``load_latency``, ...).
    """

    def __init__(
        self,
        lora_dir: str,
        *,
        port: int = 0,
        model: str = "tiny-base",
        env: Optional[Dict[str, str]] = None,
        hidden: Optional[Dict[str, int]] = None,
        resolver: bool = True,
        **settings: Any,
    ):
        self.lora_dir, self.model = lora_dir, model
        #: What a restart passes on (all but the port and the hidden names).
        self._options: Dict[str, Any] = dict(settings, model=model, env=env, resolver=resolver)
        argv = [sys.executable, "-m", "lora_sampler.testing", "--commands", "--lora-dir", lora_dir, "--port", str(port)]
        argv += [f"--{name.replace('_', '-')}={value}" for name, value in dict(settings, model=model).items()]
        argv += [] if resolver else ["--no-resolver"]
        argv += [f"--hide={name}={count}" for name, count in (hidden or {}).items()]
        self.process: subprocess.Popen[str] = subprocess.Popen(  # noqa: S603 (our own interpreter and module)
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **(env or {})),
            start_new_session=True,
        )
        self.url = self._read_line(START_TIMEOUT).strip()
        if not self.url:
            self.stop()
            raise RuntimeError(f"the engine process printed no URL line within {START_TIMEOUT} s")
        self.port = int(self.url.rsplit(":", 1)[1])

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def restart(self, *, hidden: Optional[Dict[str, int]] = None) -> EngineProcess:
        """Start a fresh engine on this one's port (a restarted server: same URL, empty adapter table)."""
        return EngineProcess(self.lora_dir, port=self.port, hidden=hidden, **self._options)

    def _read_line(self, timeout: float) -> str:
        stdout: Optional[IO[str]] = self.process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return ""
        return stdout.readline()

    def command(self, op: str, *, answer_within: float = 30.0, **fields: Any) -> Any:
        """Send one command and return its answer (given ``answer_within`` seconds)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        line = self._read_line(answer_within)
        if not line:
            raise RuntimeError(f"the engine process did not answer {op!r}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the engine process refused {op!r}: {answer['error']}")
        return answer["ok"]

    def requests(self) -> List[Dict[str, Any]]:
        """Return the engine's request log."""
        return list(self.command("requests"))

    def hold(self, **options: Any) -> None:
        """``FakeEngine.hold`` in the engine process (the same keyword arguments)."""
        self.command("hold", **options)

    def release(self) -> None:
        """``FakeEngine.release`` in the engine process."""
        self.command("release")

    def wait_for_held(self, count: int = 1, timeout: float = 60.0) -> None:
        """``FakeEngine.wait_for_held`` in the engine process.

        Raises:
            RuntimeError: fewer than ``count`` completions were held after ``timeout`` seconds.
        """
        self.command("wait_for_held", answer_within=timeout + 30.0, count=count, timeout=timeout)

    def kill(self) -> None:
        """Kill the engine at once (SIGKILL), as a crashed server dies."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Stop the engine's process group and close its pipes. Idempotent."""
        stop_group(self.process)
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


# -- the child (``python -m lora_sampler.testing --commands``) ---------------------------------------------------


def _commands(engine: FakeEngine) -> Dict[str, Callable[..., Any]]:
    """What each command calls, with the command's other fields as keyword arguments (None answers True)."""

    def slow_unload(seconds: float) -> None:
        engine.unload_latency = float(seconds)

    return {
        "hold": engine.hold,
        "release": engine.release,
        "wait_for_held": engine.wait_for_held,
        "delay": engine.set_visibility_delay,
        "fault": engine.inject_fault,
        "requests": lambda: [dataclasses.asdict(r) for r in engine.requests],
        "max_loads": engine.max_loads_in_flight_for,
        "loaded": lambda: engine.loaded_adapters,
        "reset": engine.reset_log,
        "runtime": engine.set_runtime_lora_updating,
        "slow_unload": slow_unload,
    }


def serve_commands(engine: FakeEngine, stop: threading.Event) -> None:
    """Answer the command lines on stdin, one JSON line each, until stdin closes (the test is gone): then ``stop``."""
    commands = _commands(engine)
    for line in sys.stdin:
        try:
            fields = json.loads(line)
            outcome = commands[fields.pop("op")](**fields)
            answer: Dict[str, Any] = {"ok": True if outcome is None else outcome}
        except Exception as exc:  # one bad command must not end the engine
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    stop.set()
