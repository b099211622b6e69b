"""Hostile engines, timed: headers dripped one byte per 0.5 s, and an engine whose health answers but completions hang.

Run from any checkout (its ``lora_sampler`` is the one measured)::

    python benchmarks/bench_hostile.py [--only drip|cli|hung] [--cap 120] [--name bench_hostile]

* ``drip``: ``sample`` with ``timeout=(1, 2)`` and one attempt against a server sending its status line and headers
  one byte every 0.5 s (for at most ``--cap`` seconds): the seconds the call took.
* ``cli``: ``lora-sampler sample --timeout 1,2`` against the same server: the seconds until it exited, and its status.
* ``tarbomb``: extracting a ~1 MB ``.tar.gz`` whose PAX extended header holds 1 GiB: the seconds and the peak
  RSS above the interpreter's own (``ru_maxrss`` of a child process), and the error.
* ``hung``: a 100-line job with ``--timeout 1,2 --max-outage 30`` against a FakeEngine whose completions never
  answer while ``/health`` and ``/v1/models`` do: the seconds, the exit status and the completions sent.

Results go to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict

import _common

sys.path.insert(0, os.path.join(_common.REPO, "tests", "socket"))  # the raw socket server of the tests

from rawserver import RawServer

from lora_sampler import LoraSamplerError, RetryPolicy, SamplerClient
from lora_sampler.testing import FakeEngine


def dripping(cap: float, stop: threading.Event) -> Callable[[socket.socket, int], None]:
    """A handler sending a status line and ~1 KB of headers one byte per 0.5 s, for at most ``cap`` seconds."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 1000 + b"\r\n\r\n"

    def handler(conn: socket.socket, index: int) -> None:
        started = time.monotonic()
        for byte in head:
            if time.monotonic() - started > cap or stop.wait(0.5):
                return
            conn.sendall(bytes([byte]))

    return handler


def bench_drip(cap: float) -> Dict[str, Any]:
    """Time one ``sample`` call against the dripping server."""
    stop = threading.Event()
    with RawServer(dripping(cap, stop)) as server:
        with SamplerClient(server.url, timeout=(1, 2), retry=RetryPolicy(max_attempts=1)) as client:
            started = time.monotonic()
            try:
                client.sample([1], base_model="m")
                outcome = "answered"
            except LoraSamplerError as error:
                outcome = type(error).__name__
            finally:
                seconds = time.monotonic() - started
                stop.set()
    return {"seconds": round(seconds, 1), "outcome": outcome, "server_cap_seconds": cap}


def _cli(args: list, cwd: str, timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=_common.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_sampler", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        status = proc.wait(timeout=timeout)
    finally:
        _common.stop_group(proc)
    return {"seconds": round(time.monotonic() - started, 1), "exit": status}


def _prompts(folder: str, count: int) -> str:
    path = os.path.join(folder, "in.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for number in range(count):
            f.write(json.dumps({"id": f"p{number}", "prompt": [5, 6, 7]}) + "\n")
    return path


def bench_cli(cap: float) -> Dict[str, Any]:
    """Time ``lora-sampler sample`` (its startup check) against the dripping server."""
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as folder, RawServer(dripping(cap, stop)) as server:
        inp = _prompts(folder, 1)
        args = ["sample", "--base-url", server.url, "--base-model", "m", "--input", inp]
        try:
            result = _cli(
                [*args, "--output", os.path.join(folder, "o"), "--timeout", "1,2", "--quiet"], folder, cap + 60
            )
        finally:
            stop.set()
    return {**result, "server_cap_seconds": cap}


def bench_hung(count: int = 100) -> Dict[str, Any]:
    """Time a ``count``-line job against an engine whose completions hang while its health answers."""
    with tempfile.TemporaryDirectory() as folder, FakeEngine() as engine:
        engine.inject_fault("hang", count=10**9, seconds=30.0)
        inp = _prompts(folder, count)
        args = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", inp, "--quiet"]
        args += ["--output", os.path.join(folder, "o"), "--timeout", "1,2", "--max-outage", "30"]
        result = _cli(args, folder, 600)
        sent = engine.calls("/v1/completions")
    return {**result, "lines": count, "completions_sent": sent}


_EXTRACT = """
import resource, sys, time
from lora_sampler._adapters.extract import extract_archive
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.monotonic()
try:
    extract_archive(sys.argv[1], sys.argv[2])
    outcome = "extracted"
except Exception as error:
    outcome = type(error).__name__
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(round(time.monotonic() - started, 1), round(grown / 1024), outcome)
"""


def bench_tarbomb(claim: int = 1 << 30) -> Dict[str, Any]:
    """Time extracting an archive whose PAX header holds ``claim`` bytes of zeros, and its memory growth."""
    import gzip
    import tarfile

    with tempfile.TemporaryDirectory() as folder:
        archive = os.path.join(folder, "bomb.tar.gz")
        header = tarfile.TarInfo("././@PaxHeader")
        header.type, header.size = tarfile.XHDTYPE, claim
        with gzip.open(archive, "wb", compresslevel=9) as out:
            out.write(header.tobuf(format=tarfile.USTAR_FORMAT))
            zeros = bytes(1 << 20)
            for _ in range(claim >> 20):
                out.write(zeros)
        dest = os.path.join(folder, "out")
        os.mkdir(dest)
        env = dict(os.environ, PYTHONPATH=_common.REPO)
        line = subprocess.run(
            [sys.executable, "-c", _EXTRACT, archive, dest], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        return {
            "archive_bytes": os.path.getsize(archive),
            "claimed_bytes": claim,
            "seconds": float(line[0]),
            "rss_growth_mb": int(line[1]),
            "outcome": line[2],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("drip", "cli", "hung", "tarbomb"))
    parser.add_argument("--cap", type=float, default=120.0, help="seconds the dripping server drips at most")
    parser.add_argument("--name", default="bench_hostile")
    args = parser.parse_args()
    results: Dict[str, Any] = {"machine": _common.machine()}
    runs: Dict[str, Callable[[], Dict[str, Any]]] = {"drip": lambda: bench_drip(args.cap)}
    runs.update(cli=lambda: bench_cli(args.cap), hung=bench_hung, tarbomb=bench_tarbomb)
    for name, run in runs.items():
        if args.only in (None, name):
            results[name] = run()
            print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(_common.RESULTS_DIR, f"{args.name}.json"), "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
