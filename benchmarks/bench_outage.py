"""A batch job across an engine outage: what ``lora-sampler sample`` does when the engine dies mid-run.

A ``FakeEngine`` runs in its own process (``lora_sampler.testing._serve.EngineProcess``, 10 ms per completion);
``lora-sampler sample`` runs in another, over 3,000 lines at concurrency 16, with the real retry waits. At about 25%
of the lines the engine is SIGKILLed; scenarios:

* ``--max-outage 0`` (fail fast, the behaviour before outages were waited out), engine restarted 3 s later;
* ``--max-outage 600`` (the default), engine restarted 3 s later on the same port, with the adapter hidden from its
  resolver for 3 completions (a restarted engine that forgot the adapter);
* ``--max-outage 5``, the engine never comes back: seconds from the kill to the exit;
* a hung engine (accepts connections, never answers) at the start, default flags: seconds until the CLI exits 2.

Reported per scenario: exit status, answered and error rows, seconds from the kill to the exit.

    python benchmarks/bench_outage.py [--lines 3000] [--restart-after 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import _common

from lora_sampler.publish import default_adapter_name
from lora_sampler.testing import write_adapter_archive
from lora_sampler.testing._serve import EngineProcess

CONCURRENCY, LATENCY = 16, 0.01
#: The checkout importable in the CLI processes (the engine process inherits ``sys.path``).
ENV = {"PYTHONPATH": _common.REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _rows(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


def scenario(root: str, lines: int, max_outage: float, restart_after: Optional[float]) -> Dict[str, Any]:
    """Run one CLI job, kill the engine at 25%, restart it after ``restart_after`` s (None: never); measure."""
    work = tempfile.mkdtemp(dir=root)
    lora_dir = os.path.join(work, "loras")
    os.mkdir(lora_dir)
    source, target = os.path.join(work, "in.jsonl"), os.path.join(work, "out.jsonl")
    with open(source, "w", encoding="utf-8") as handle:
        for number in range(1, lines + 1):
            handle.write(json.dumps({"id": f"p{number}", "prompt": [5 + number % 200, 6, 7]}) + "\n")
    restarted: Optional[EngineProcess] = None
    with EngineProcess(lora_dir, latency=LATENCY) as engine:
        archive = write_adapter_archive(os.path.join(work, "step-1.tar.gz"), engine.model)
        argv = [sys.executable, "-m", "lora_sampler", "sample", "--base-url", engine.url, "--lora-base-dir", lora_dir]
        argv += ["--adapter", archive, "--input", source, "--output", target, "--concurrency", str(CONCURRENCY)]
        argv += ["--quiet", "--max-outage", str(max_outage)]
        stderr_path = os.path.join(work, "stderr.txt")
        with open(stderr_path, "wb") as stderr:
            cli = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=stderr, env=dict(os.environ, **ENV), start_new_session=True
            )
        try:
            while len(_rows(target)) < lines // 4 and cli.poll() is None:
                time.sleep(0.01)
            engine.kill()
            killed, at = time.monotonic(), len(_rows(target))
            if restart_after is not None:
                time.sleep(restart_after)
                restarted = engine.restart(hidden={default_adapter_name(archive): 3})
            status = cli.wait(timeout=900)
            took = time.monotonic() - killed
        finally:
            _stop_cli(cli)
            if restarted is not None:
                restarted.stop()
    rows = _rows(target)
    errors = sum("error" in row for row in rows)
    with open(stderr_path, encoding="utf-8", errors="replace") as handle:
        last = [line for line in handle.read().splitlines() if line.startswith("lora-sampler: error")][-1:]
    return {
        "max_outage": max_outage,
        "restart_after": restart_after,
        "exit": status,
        "killed_at_row": at,
        "answered": len(rows) - errors,
        "error_rows": errors,
        "seconds_kill_to_exit": round(took, 2),
        "last_error": last[0][:300] if last else "",
    }


def hung_start(root: str) -> Dict[str, Any]:
    """Start the CLI (default flags) against a server that accepts connections and never answers; time its exit."""
    source = os.path.join(tempfile.mkdtemp(dir=root), "in.jsonl")
    with open(source, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": 1, "prompt": [5, 6, 7]}) + "\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        argv = [sys.executable, "-m", "lora_sampler", "sample", "--base-url", url, "--base-model", "tiny-base"]
        argv += ["--input", source, "--output", source + ".out", "--quiet"]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, **ENV), timeout=900)
        took = time.monotonic() - started
    return {"exit": done.returncode, "seconds_to_exit": round(took, 2), "message": done.stderr.strip()[-300:]}


def _stop_cli(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--restart-after", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as root:
        results = [
            scenario(root, args.lines, 0.0, args.restart_after),
            scenario(root, args.lines, 600.0, args.restart_after),
            scenario(root, args.lines, 5.0, None),
        ]
        hung = hung_start(root)
    headers = ["--max-outage", "engine back after", "exit", "answered", "error rows", "s kill to exit"]
    rows = [
        [
            r["max_outage"],
            "never" if r["restart_after"] is None else f"{r['restart_after']:g} s",
            r["exit"],
            r["answered"],
            r["error_rows"],
            r["seconds_kill_to_exit"],
        ]
        for r in results
    ]
    print(_common.table(headers, rows))
    print()
    print(_common.markdown_table(headers, rows))
    print(
        f"\nhung engine at the start (default --timeout 10,300): exit {hung['exit']} after {hung['seconds_to_exit']} s"
    )
    payload = {
        "when": _common.stamp(),
        "command": "python benchmarks/bench_outage.py " + " ".join(sys.argv[1:]),
        "machine": _common.machine(),
        "lines": args.lines,
        "concurrency": CONCURRENCY,
        "latency_s": LATENCY,
        "results": results,
        "hung_engine_at_start": hung,
    }
    print(f"\nwrote {_common.write_results('bench_outage', payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
