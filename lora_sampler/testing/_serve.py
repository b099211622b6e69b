"""A ``FakeEngine`` out of process: ``python -m lora_sampler.testing`` (and ``lora-sampler serve-test-engine``) serves
one on a port until Ctrl-C, and ``EngineProcess`` runs that same command as a test's child it can kill and restart.

For trying the command line, or one's own evaluation code, without a GPU or a vLLM install: it serves the vLLM subset
``FakeEngine`` speaks, with a resolver folder to publish into, and prints the flags to point a client at it (the URL
alone on stdout, its first line). Stdlib only; it listens on loopback unless told otherwise.

For a test that kills an engine like a crashed vLLM server and starts it again (same port, every adapter forgotten),
``EngineProcess`` starts ``python -m lora_sampler.testing`` in its own process group, its settings as flags plus three
that are hidden from its help and absent from the CLI's: ``--commands``, ``--no-resolver`` (no filesystem resolver)
and ``--hide NAME=K`` (hide ``lora_dir/NAME`` for its first K completions from the start: a restarted engine that has
forgotten an adapter and sees it late). With ``--commands`` the child reads JSON command lines on its standard input
and answers each with one JSON line (``{"ok": ...}`` or ``{"error": "..."}``):

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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any, Callable, Dict, List, Optional

from lora_sampler.testing._engine import FakeEngine

#: The port served unless ``--port`` says otherwise (vLLM's own default).
DEFAULT_PORT = 8000
#: Environment variables the engine's API key is read from, in order (as a vLLM server reads ``VLLM_API_KEY``).
KEY_VARIABLES = ("LORA_SAMPLER_API_KEY", "VLLM_API_KEY")
#: The ``FakeEngine`` settings taken as flags, each spelled as its keyword with dashes, with FakeEngine's default
#: (``--port``'s is ``DEFAULT_PORT``): keyword, type, metavar (None: argparse's), what it sets.
ENGINE_FLAGS = (
    ("host", str, None, "address to listen on"),
    ("port", int, None, "port to listen on; 0 picks a free one"),
    ("model", str, None, "the base model's name"),
    ("max_model_len", int, None, "context length in tokens"),
    ("latency", float, "SECONDS", "service time of each completion"),
    ("load_latency", float, "SECONDS", "time of each adapter load"),
    ("max_loras", int, None, "adapters held in memory before the oldest is evicted"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the test engine's options to ``parser``."""
    defaults = {name: option.default for name, option in inspect.signature(FakeEngine).parameters.items()}
    defaults["port"] = DEFAULT_PORT
    for name, kind, metavar, text in ENGINE_FLAGS:
        flag, default = "--" + name.replace("_", "-"), defaults[name]
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{text} (default: {default})")
    parser.add_argument(
        "--lora-dir",
        metavar="DIR",
        help="the resolver folder adapters are published into (pass it as --lora-base-dir); default: a temporary "
        "folder, removed on exit",
    )
    parser.add_argument(
        "--require-api-key",
        action="store_true",
        help=f"answer 401 without the key in ${KEY_VARIABLES[0]} (else ${KEY_VARIABLES[1]}), as vLLM's --api-key does",
    )
    parser.add_argument(
        "--no-runtime-lora-updating",
        action="store_true",
        help="serve without /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM without "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    )
    parser.set_defaults(commands=False, resolver=True, hide=[])  # main's hidden flags (EngineProcess's)


def serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (or SIGTERM; with ``--commands`` also until stdin closes); return the exit status (0).

    Args:
        args: The options of ``add_arguments`` (and of ``main``'s hidden flags, when it parsed them).
    """
    key = next((os.environ[name] for name in KEY_VARIABLES if os.environ.get(name)), None)
    if args.require_api_key and key is None:
        print(f"serve-test-engine: --require-api-key needs ${KEY_VARIABLES[0]} or ${KEY_VARIABLES[1]}", file=sys.stderr)
        return 2
    temporary = None if args.lora_dir else tempfile.mkdtemp(prefix="lora-sampler-test-engine-")
    lora_dir = os.path.abspath(args.lora_dir or str(temporary))
    os.makedirs(lora_dir, exist_ok=True)
    try:
        engine = FakeEngine(
            **{name: vars(args)[name] for name, *_ in ENGINE_FLAGS},
            lora_dir=lora_dir if args.resolver else None,
            api_key=key if args.require_api_key else None,
            runtime_lora_updating=not args.no_runtime_lora_updating,
        )
        for name, count in args.hide:
            engine.set_visibility_delay(name, requests=count)
        stop = threading.Event()

        def say_ready() -> None:
            lines = [
                f"serve-test-engine: a FakeEngine serving {engine.model!r} at {engine.url} (Ctrl-C stops it)",
                f"  resolver folder: {lora_dir}{' (temporary: removed on exit)' if temporary else ''}",
                f"  try: lora-sampler doctor --base-url {engine.url} --lora-base-dir {lora_dir}",
            ]
            if args.require_api_key:
                lines.append("  the engine wants the API key of the environment variable it was read from")
            print("\n".join(lines), file=sys.stderr, flush=True)
            print(engine.url, flush=True)  # stdout: the URL alone, for scripts (and EngineProcess)
            if args.commands:
                threading.Thread(target=serve_commands, args=(engine, stop), daemon=True).start()

        serve_until_stopped(engine, stop, say_ready)
        print("serve-test-engine: stopped", file=sys.stderr)
        return 0
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def serve_until_stopped(engine: FakeEngine, stop: threading.Event, ready: Callable[[], None]) -> None:
    """Serve ``engine`` until ``stop`` is set or SIGINT/SIGTERM comes; ``ready`` runs once it listens.

    Called in the main thread (where handlers can be set); the handlers before are restored.
    """
    previous = {
        signum: signal.signal(signum, lambda number, frame: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with engine:
            ready()
            while not stop.wait(0.2):  # a bounded wait, so Ctrl-C is heard at once on every platform
                pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _hidden_name(value: str) -> tuple[str, int]:
    """``--hide NAME=K``: an adapter name and the completions it stays hidden for."""
    name, _, count = value.rpartition("=")
    return name, int(count)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``python -m lora_sampler.testing``."""
    parser = argparse.ArgumentParser(
        prog="python -m lora_sampler.testing",
        description="Serve lora_sampler's built-in test engine (a vLLM stand-in) on a port until Ctrl-C.",
    )
    add_arguments(parser)
    # EngineProcess's flags (see the module's docstring): hidden, and not in the CLI's serve-test-engine.
    parser.add_argument("--commands", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-resolver", dest="resolver", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("--hide", type=_hidden_name, action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # a bad flag exits 2 with argparse's message
    try:
        return serve(args)
    except OSError as exc:  # the port is taken, the folder cannot be made
        print(f"serve-test-engine: error: {exc}", file=sys.stderr)
        return 2


# -- EngineProcess: the engine as a test's child process ----------------------------------------------------------

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


# -- the child's command lines (``--commands``) -------------------------------------------------------------------


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
