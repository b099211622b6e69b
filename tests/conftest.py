"""Shared fixtures: every test starts and ends with the retry testing switch off."""

from __future__ import annotations

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
