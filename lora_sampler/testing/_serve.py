"""``python -m lora_sampler.testing`` (and ``lora-sampler serve-test-engine``): a ``FakeEngine`` on a port until Ctrl-C.

For trying the command line, or one's own evaluation code, without a GPU or a vLLM install: it serves the vLLM subset
``FakeEngine`` speaks, with a resolver folder to publish into, and prints the flags to point a client at it. Stdlib
only; it listens on loopback unless told otherwise.

It is also the child ``EngineProcess`` (``_process``) starts: ``python -m lora_sampler.testing`` takes three more
flags, hidden from its help and absent from the CLI's: ``--commands`` (serve ``EngineProcess``'s JSON command lines
on stdin, and stop when stdin closes), ``--no-resolver`` (no filesystem resolver) and ``--hide NAME=K`` (hide
``lora_dir/NAME`` for its first K completions from the start). Either way the URL is the first line on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Callable, List, Optional

from lora_sampler.testing._engine import FakeEngine
from lora_sampler.testing._process import serve_commands

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
