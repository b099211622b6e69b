"""A ``FakeEngine`` out of process: ``python -m lora_sampler.testing`` (and ``lora-sampler serve-test-engine``) serves
one on a port until Ctrl-C, and ``EngineProcess`` runs one as a test's child process it can kill and restart.

For trying the command line, or one's own evaluation code, without a GPU or a vLLM install: it serves the vLLM subset
``FakeEngine`` speaks, with a resolver folder to publish into, and prints the flags to point a client at it (the URL
alone on stdout, its first line). Stdlib only; it listens on loopback unless told otherwise.

For a test (or a benchmark) that kills an engine like a crashed vLLM server and starts it again (same port, every
adapter forgotten), or keeps its threads off the client's GIL, ``EngineProcess`` spawns a fresh interpreter
(``multiprocessing``) that builds the ``FakeEngine`` of its keyword arguments and answers commands sent over a pipe,
each a ``FakeEngine`` control with its keyword arguments (``_commands``): ``delay`` (``set_visibility_delay``),
``fault`` (``inject_fault``), ``requests`` (the request log as ``RequestRecord`` dicts), ``max_loads``
(``max_loads_in_flight_for``), ``loaded`` (the registered adapter names), ``swaps`` (``adapter_swaps``), ``reset``
(``reset_log``), ``runtime`` (``set_runtime_lora_updating``), ``slow_unload`` (``seconds``: every later
``/v1/unload_lora_adapter`` answers after them, ``FakeEngine.unload_latency``), and ``hold``, ``release`` and
``wait_for_held``. The child serves until its end of the pipe closes (the test stopped it, or is gone), so it never
outlives the test that started it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Optional

from lora_sampler.testing._engine import FakeEngine

#: The port served unless ``--port`` says otherwise (vLLM's own default).
DEFAULT_PORT = 8000
#: Environment variables the engine's API key is read from, in order (as a vLLM server reads ``VLLM_API_KEY``).
KEY_VARIABLES = ("LORA_SAMPLER_API_KEY", "VLLM_API_KEY")
#: The signals that stop ``serve`` (Ctrl-C, and ``kill``'s default).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
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


def serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (or SIGTERM); return the exit status (0).

    Args:
        args: The options of ``add_arguments``.
    """
    key = next((os.environ[name] for name in KEY_VARIABLES if os.environ.get(name)), None)
    if args.require_api_key and key is None:
        print(f"serve-test-engine: --require-api-key needs ${KEY_VARIABLES[0]} or ${KEY_VARIABLES[1]}", file=sys.stderr)
        return 2
    temporary = None if args.lora_dir else tempfile.mkdtemp(prefix="lora-sampler-test-engine-")
    lora_dir = os.path.abspath(args.lora_dir or str(temporary))
    os.makedirs(lora_dir, exist_ok=True)
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda number, frame: stop.set()) for signum in STOP_SIGNALS}
    try:
        engine = FakeEngine(
            **{name: vars(args)[name] for name, *_ in ENGINE_FLAGS},
            lora_dir=lora_dir,
            api_key=key if args.require_api_key else None,
            runtime_lora_updating=not args.no_runtime_lora_updating,
        )
        with engine:
            lines = [
                f"serve-test-engine: a FakeEngine serving {engine.model!r} at {engine.url} (Ctrl-C stops it)",
                f"  resolver folder: {lora_dir}{' (temporary: removed on exit)' if temporary else ''}",
                f"  try: lora-sampler doctor --base-url {engine.url} --lora-base-dir {lora_dir}",
            ]
            if args.require_api_key:
                lines.append("  the engine wants the API key of the environment variable it was read from")
            print("\n".join(lines), file=sys.stderr, flush=True)
            print(engine.url, flush=True)  # stdout: the URL alone, for scripts
            while not stop.wait(0.2):  # a bounded wait, so Ctrl-C is heard at once on every platform
                pass
        print("serve-test-engine: stopped", file=sys.stderr)
        return 0
    finally:
        for signum, handler in previous.items():  # serve runs in the main thread, where handlers are set
            signal.signal(signum, handler)
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``python -m lora_sampler.testing``."""
    parser = argparse.ArgumentParser(
        prog="python -m lora_sampler.testing",
        description="Serve lora_sampler's built-in test engine (a vLLM stand-in) on a port until Ctrl-C.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)  # a bad flag exits 2 with argparse's message
    try:
        return serve(args)
    except OSError as exc:  # the port is taken, the folder cannot be made
        print(f"serve-test-engine: error: {exc}", file=sys.stderr)
        return 2


# -- EngineProcess: the engine as a test's child process ----------------------------------------------------------

#: Seconds a child gets to report its URL.
START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL when a process group is stopped (and a stopped child gets to end).
STOP_GRACE = 5.0
#: A fresh interpreter per engine process: forking a test process that runs threads could copy a held lock.
_SPAWN = multiprocessing.get_context("spawn")


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
    """A FakeEngine in a child process of its own, driven by commands over a pipe (see the module's docstring).

    Use it as a context manager (or call ``stop``): the child is always ended. ``kill`` is a crash (SIGKILL);
    ``restart`` starts a fresh engine on the same port (same URL, empty adapter table), as a redeployed server. The
    child is spawned (``multiprocessing``), so a script that starts one keeps its work under
    ``if __name__ == "__main__":`` (the child imports the script's main module; pytest's and the benchmarks' do).

    Args:
        lora_dir: The engine's resolver directory.
        port: Where to listen (0 picks a free port).
        model: The base model name.
        hidden: Adapter names hidden from the resolver for their first K completions, set before it listens.
        resolver: False serves without the filesystem resolver (adapters only once loaded; ``lora_dir`` unread).
        settings: More ``FakeEngine`` keyword arguments (``latency``, ``load_latency``, ...).

    Raises:
        RuntimeError: the child did not report its URL within ``START_TIMEOUT`` seconds, or refused to start (the
            port is taken, a bad setting), saying why.
    """

    def __init__(
        self,
        lora_dir: str,
        *,
        port: int = 0,
        model: str = "tiny-base",
        hidden: Optional[Dict[str, int]] = None,
        resolver: bool = True,
        **settings: Any,
    ):
        self.lora_dir, self.model = lora_dir, model
        #: What a restart passes on (all but the port and the hidden names).
        self._options: Dict[str, Any] = dict(settings, model=model, resolver=resolver)
        engine = dict(settings, model=model, port=port, lora_dir=lora_dir if resolver else None)
        self._pipe, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_serve_commands, args=(engine, hidden or {}, child), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child alone: its death reads as end of file here
        try:
            self.url: str = self._answer("start", START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def restart(self, *, hidden: Optional[Dict[str, int]] = None) -> EngineProcess:
        """Start a fresh engine on this one's port (a restarted server: same URL, empty adapter table)."""
        return EngineProcess(self.lora_dir, port=self.port, hidden=hidden, **self._options)

    def command(self, op: str, *, answer_within: float = 30.0, **fields: Any) -> Any:
        """Send one command and return its answer (given ``answer_within`` seconds)."""
        self._pipe.send((op, fields))
        return self._answer(op, answer_within)

    def _answer(self, op: str, timeout: float) -> Any:
        """The child's answer to ``op``.

        Raises:
            RuntimeError: no answer within ``timeout`` seconds, the child ended first, or it refused ``op`` (why).
        """
        if not self._pipe.poll(timeout):
            raise RuntimeError(f"the engine process did not answer {op!r} within {timeout:g} s")
        try:
            done, answer = self._pipe.recv()
        except EOFError:
            raise RuntimeError(f"the engine process ended before it answered {op!r}") from None
        if not done:
            raise RuntimeError(f"the engine process refused {op!r}: {answer}")
        return answer

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
        self.process.kill()
        self.process.join()

    def stop(self) -> None:
        """End the engine: close the pipe (the child stops its engine and exits), then SIGKILL after ``STOP_GRACE``
        seconds. Idempotent."""
        self._pipe.close()
        self.process.join(STOP_GRACE)
        if self.process.is_alive():
            self.kill()


# -- the child ----------------------------------------------------------------------------------------------------


def _commands(engine: FakeEngine) -> Dict[str, Callable[..., Any]]:
    """What each command calls, with the command's other fields as keyword arguments."""

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
        "swaps": lambda: engine.adapter_swaps,
        "reset": engine.reset_log,
        "runtime": engine.set_runtime_lora_updating,
        "slow_unload": slow_unload,
    }


def _serve_commands(settings: Dict[str, Any], hidden: Dict[str, int], pipe: Connection) -> None:
    """The engine process: start the engine of ``settings`` (``hidden`` names hidden first), send its URL, then answer
    each ``(op, fields)`` with ``(True, answer)`` or ``(False, why)`` until the pipe closes; then stop the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on a test run: the test's process ends this one
    try:
        engine = FakeEngine(**settings)
        for name, count in hidden.items():
            engine.set_visibility_delay(name, requests=count)
        engine.start()
    except Exception as exc:  # the port is taken, a bad setting: said to the test
        pipe.send((False, f"{type(exc).__name__}: {exc}"))
        return
    try:
        commands = _commands(engine)
        pipe.send((True, engine.url))
        while True:
            try:
                op, fields = pipe.recv()
            except EOFError:  # the test stopped the engine, or is gone
                return
            try:
                pipe.send((True, commands[op](**fields)))
            except Exception as exc:  # one bad command must not end the engine
                pipe.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        engine.stop()
