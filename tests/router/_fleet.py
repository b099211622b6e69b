"""Process plumbing for the router tests: FakeEngine replicas in processes of their own, and a real vllm-router.

Every process starts in its own process group and is stopped by the fixture that started it (SIGTERM, then
SIGKILL). Nothing is installed at test time: ``tox -e router`` installs vllm-router; without its executable the
tests fail with a message saying so. Loopback only.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any, Dict, List, Optional

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_MODEL = "tiny-base"
#: vllm-router's answer when a worker cannot be reached (ROUTER.md §3c).
ROUTER_DEAD_WORKER = "Request failed: error sending request"
START_TIMEOUT = 30.0
STOP_GRACE = 5.0


def free_port() -> int:
    """Return a loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_executable() -> str:
    """Return the vllm-router console script, or fail (never skip) saying how to get it."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")
    if not found:
        pytest.fail(
            "the vllm-router executable is missing: run these tests with `tox -e router` (which installs "
            "vllm-router), or `pip install vllm-router==0.1.17` into this environment",
            pytrace=False,
        )
    return found


def stop_group(process: subprocess.Popen[Any]) -> None:
    """Stop a process and its whole group: SIGTERM, wait, then SIGKILL. Idempotent."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group, if any


class Replica:
    """A FakeEngine in its own process (``_replica.py``), driven by JSON command lines on its standard input."""

    def __init__(
        self,
        lora_dir: str,
        *,
        port: int = 0,
        latency: float = 0.0,
        load_latency: float = 0.0,
        env: Optional[Dict[str, str]] = None,
        api_key_env: Optional[str] = None,
    ):
        self.lora_dir, self.latency, self.load_latency = lora_dir, latency, load_latency
        argv = [sys.executable, os.path.join(HERE, "_replica.py"), "--lora-dir", lora_dir, "--port", str(port)]
        argv += ["--latency", str(latency), "--load-latency", str(load_latency), "--model", BASE_MODEL]
        if api_key_env:
            argv += ["--api-key-env", api_key_env]
        self.process: subprocess.Popen[str] = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **(env or {})),
            start_new_session=True,
        )
        line = self._read_line(START_TIMEOUT)
        if not line:
            self.stop()
            raise RuntimeError("the replica printed no URL line")
        self.url: str = json.loads(line)["url"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def restart(self) -> Replica:
        """Start a fresh replica on this one's port (a restarted server: same URL, empty adapter table)."""
        return Replica(self.lora_dir, port=self.port, latency=self.latency, load_latency=self.load_latency)

    def _read_line(self, timeout: float) -> str:
        stdout: Optional[IO[str]] = self.process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return ""
        return stdout.readline()

    def command(self, op: str, **fields: Any) -> Any:
        """Send one command and return its answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        line = self._read_line(30.0)
        if not line:
            raise RuntimeError(f"the replica did not answer {op!r}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the replica refused {op!r}: {answer['error']}")
        return answer["ok"]

    def requests(self) -> List[Dict[str, Any]]:
        """Return the replica's request log."""
        return list(self.command("requests"))

    def kill(self) -> None:
        """Kill the replica at once (SIGKILL), as a crashed server dies."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Stop the replica's process group and close its pipes."""
        stop_group(self.process)
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


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
