"""The ``lora_engine`` pytest fixture: a started ``FakeEngine`` per test (registered as a ``pytest11`` plugin).

It also switches lora_sampler's retry waits off for the test (attempts are kept) and restores the previous state
afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_sampler.testing import FakeEngine, set_testing


@pytest.fixture
def lora_engine(tmp_path: Path) -> Iterator[FakeEngine]:
    """Yield a running ``FakeEngine`` whose resolver directory is ``tmp_path / "loras"``; stop it afterwards."""
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    with set_testing(True), FakeEngine(lora_dir=lora_dir) as engine:
        yield engine
