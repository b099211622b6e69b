"""Shared fixtures: the retry testing switch off at the start and end of every test, and the resolver folder."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from lora_sampler import retry


@pytest.fixture(autouse=True)
def _reset_testing_switch() -> Iterator[None]:
    retry.set_testing(False)
    yield
    retry.set_testing(False)


@pytest.fixture
def no_waits() -> Iterator[None]:
    """Retry waits are 0 s for this test (attempts are kept)."""
    with retry.set_testing(True):
        yield


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    """The engine's resolver folder (``tmp_path / "loras"``)."""
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder
