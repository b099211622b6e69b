"""Throughput through vllm-router against direct: lora_sampler at c=16 and 64, 20 ms service time.

Contenders, run alternately, several rounds, in this one process (the medians are reported with the ratio):

- ``direct``: ``SamplerClient(engine).sample_many`` against one FakeEngine process;
- ``router``: the same client against vllm-router (``--policy consistent_hash``) over three FakeEngine processes,
  each request with its own ``X-Session-ID`` (lora_sampler's default), so sessions spread over the three.

Each FakeEngine serves every request in a thread of its own after a fixed latency, so the ideal is c / 20 ms for
both; what the router costs shows as the ratio.

The router's output goes to ``$TMPDIR/bench_router-<pid>.log``: a router writing into a pipe nobody drains blocks
once the pipe is full, which looks exactly like requests stalling through the router.
Needs the ``vllm-router`` executable (``pip install vllm-router``).

    python benchmarks/bench_router.py [--quick] [--rounds 3] [--concurrency 16 64] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List

import _common

MODEL = "bench/base-model"
PROMPT = [1, 45, 49, 173, 170, 43, 172, 97]
CONTENDERS = ("direct", "router")
#: Requests per measured run, per unit of concurrency.
REQUESTS_PER_SLOT = 40


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_process(worker_urls: List[str]) -> _common.ServerProcess:
    """Return (not started) vllm-router in its own process group; it prints its URL line, then execs the router."""
    executable = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    executable = executable if os.access(executable, os.X_OK) else shutil.which("vllm-router") or ""
    if not executable:
        raise SystemExit("bench_router: the vllm-router executable is missing; pip install vllm-router==0.1.17")
    port = _free_port()
    argv = [executable, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    argv += ["--prometheus-port", str(_free_port()), "--worker-urls", *worker_urls, "--policy", "consistent_hash"]
    argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold"]
    argv += ["1", "--health-check-timeout-secs", "1", "--worker-startup-check-interval", "1", "--log-level", "warning"]
    # After its URL line, the router's own output goes to a log file: left on the pipe nobody drains, its log lines
    # fill the pipe and the router blocks mid-request (that was the "stall at 16 in flight" this bench once hit).
    launcher = (
        "import json, os, sys; print(json.dumps({'url': sys.argv[1]}), flush=True); "
        "fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644); os.dup2(fd, 1); os.dup2(fd, 2); "
        "os.execv(sys.argv[3], sys.argv[3:])"
    )
    log = os.path.join(tempfile.gettempdir(), f"bench_router-{os.getpid()}.log")
    return _common.ServerProcess([sys.executable, "-c", launcher, f"http://127.0.0.1:{port}", log, *argv])


#: A FakeEngine (threaded, stdlib) in a process of its own: prints its URL line, serves until stdin closes.
FAKE_ENGINE = (
    "import json, sys\n"
    "from lora_sampler.testing import FakeEngine\n"
    "engine = FakeEngine(model=sys.argv[1], latency=float(sys.argv[2])).start()\n"
    "print(json.dumps({'url': engine.url}), flush=True)\n"
    "sys.stdin.read()\n"
    "engine.stop()\n"
)


def fake_engine(latency_ms: float) -> _common.ServerProcess:
    """Return (not started) a FakeEngine process with a fixed service time."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_common.REPO, os.environ.get("PYTHONPATH")]))}
    return _common.ServerProcess([sys.executable, "-c", FAKE_ENGINE, MODEL, str(latency_ms / 1000.0)], env=env)


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    """Wait until the router reports every worker healthy."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"vllm-router at {url} did not become healthy")


def measure(url: str, concurrency: int, n: int) -> float:
    """Return requests/s of ``sample_many`` over ``n`` base-model requests (after a short warm-up)."""
    from lora_sampler import SamplerClient, SampleRequest

    requests = [SampleRequest([*PROMPT, i % 200], base_model=MODEL) for i in range(n)]
    with SamplerClient(url, max_workers=concurrency, timeout=(30.0, 30.0)) as client:
        one_each = _common.one_prompt_per_request(client.sample_many)  # requests/s: one prompt per request
        client.sample_many(requests[: concurrency * 2], **one_each)
        started = time.perf_counter()
        results = client.sample_many(requests, **one_each)
        elapsed = time.perf_counter() - started
    assert all(r.sequences for r in results)
    return n / elapsed


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer requests")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    per_slot = 10 if args.quick else REQUESTS_PER_SLOT
    info = _common.machine()
    print(f"# bench_router: {_common.describe_machine(info)}", flush=True)
    samples: Dict[str, Dict[int, List[float]]] = {name: {c: [] for c in args.concurrency} for name in CONTENDERS}
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(fake_engine(args.latency_ms)) for _ in range(3)]
        router = stack.enter_context(router_process([e.url for e in engines]))
        wait_healthy(router.url)
        urls = {"direct": engines[0].url, "router": router.url}
        for round_index in range(rounds):
            for c in args.concurrency:
                order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
                for name in order:
                    rate = measure(urls[name], c, c * per_slot)
                    samples[name][c].append(rate)
                    print(f"round {round_index + 1} c={c:<3} {name:<7} {rate:8.1f} req/s", flush=True)
    ideal = {c: c / (args.latency_ms / 1000.0) for c in args.concurrency}
    rows = []
    for c in args.concurrency:
        direct, routed = _common.median(samples["direct"][c]), _common.median(samples["router"][c])
        rows.append([c, direct, routed, routed / direct, ideal[c]])
    headers = ["c", "direct req/s", "router req/s", "router/direct", "ideal req/s"]
    print()
    print(_common.table(headers, rows))
    print()
    print(_common.markdown_table(headers, rows))
    path = _common.write_results(
        "bench_router",
        {
            "when": _common.stamp(),
            "machine": info,
            "latency_ms": args.latency_ms,
            "rounds": rounds,
            "requests_per_run": {c: c * per_slot for c in args.concurrency},
            "samples": samples,
            "medians": [dict(zip(headers, row)) for row in rows],
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
