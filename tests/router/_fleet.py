"""Process plumbing for the router tests: FakeEngine replicas in processes of their own, and a real vllm-router.

A replica is ``lora_sampler.testing._serve.EngineProcess`` (shared with the socket tests), named ``Replica`` here.

Every process starts in its own process group and is stopped by the fixture that started it (SIGTERM, then
SIGKILL). Nothing is installed at test time: ``tox -e router`` installs vllm-router; without its executable the
tests skip saying so, and fail in CI (``tests/_services.py``). Loopback only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, List, Optional

import requests
from _services import unavailable

from lora_sampler.testing._serve import EngineProcess, stop_group

BASE_MODEL = "tiny-base"
#: vllm-router's answer when a worker cannot be reached.
ROUTER_DEAD_WORKER = "Request failed: error sending request"
START_TIMEOUT = 30.0
#: A FakeEngine replica in a process of its own (kill, restart on the same port, commands).
Replica = EngineProcess


def free_port() -> int:
    """Return a loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_executable() -> str:
    """Return the vllm-router console script, or skip (fail in CI) saying how to get it."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")
    if not found:
        unavailable(
            "the vllm-router executable is missing: run these tests with `tox -e router` (which installs "
            "vllm-router), or `pip install vllm-router==0.1.17` into this environment"
        )
    return found


def start_replicas(count: int, lora_dir: str, **options: Any) -> List[Replica]:
    """Start ``count`` replicas at once (each start costs a Python start-up); stop them all if any fails."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(Replica, lora_dir, **options) for _ in range(count)]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < count:
        for replica in started:
            replica.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
    return started


class Router:
    """A vllm-router process (consistent hash on ``X-Session-ID``) in its own process group.

    Args:
        worker_urls: The replicas.
        fast_health: 1 s health checks that mark a worker down after one failure (the recommended setting);
            False keeps vllm-router's defaults (60 s interval, 3 failures).
        extra: More command-line flags.
    """

    def __init__(self, worker_urls: List[str], *, fast_health: bool = True, extra: Optional[List[str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [router_executable(), "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        argv += ["--worker-urls", *worker_urls, "--policy", "consistent_hash"]
        if fast_health:
            argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
            argv += ["--health-success-threshold", "1", "--health-check-timeout-secs", "1"]
        argv += ["--worker-startup-check-interval", "1", "--log-level", "warning", *(extra or [])]
        self.process: subprocess.Popen[bytes] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
        )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the router answers ``GET /health`` with 200 (every worker healthy)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with status {self.process.returncode}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"vllm-router did not become healthy within {timeout} s")

    def wait_unhealthy(self, timeout: float = 10.0) -> str:
        """Wait until the router's health check has noticed a dead worker; return its answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                answer = requests.get(self.url + "/health", timeout=1)
                if answer.status_code != 200:
                    return answer.text
            time.sleep(0.1)
        raise RuntimeError(f"vllm-router still reports every worker healthy after {timeout} s")

    def stop(self) -> None:
        stop_group(self.process)
