"""Fixtures for the router tests: three FakeEngine replica processes behind a real vllm-router (``_fleet``).

test_fleet.py starts its own, larger fleet (module scope).
"""

from __future__ import annotations

from typing import Any, Iterator, List

import pytest
from _fleet import Replica, Router


@pytest.fixture
def lora_dir(tmp_path: Any) -> str:
    """The resolver directory every replica reads (a filesystem the whole fleet sees)."""
    path = tmp_path / "loras"
    path.mkdir()
    return str(path)


@pytest.fixture
def replicas(lora_dir: str) -> Iterator[List[Replica]]:
    """Three FakeEngine replicas (10 ms service time), each in its own process group."""
    started: List[Replica] = []
    try:
        for _ in range(3):
            started.append(Replica(lora_dir, latency=0.01, load_latency=0.02))
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
def router(replicas: List[Replica]) -> Iterator[Router]:
    """vllm-router in front of the three replicas."""
    started = Router([r.url for r in replicas])
    try:
        yield started
    finally:
        started.stop()
