"""Fixtures shared by the publishing tests."""

from __future__ import annotations

import pathlib

import pytest

from lora_sampler import publish


@pytest.fixture(autouse=True)
def _fresh_digest_cache() -> None:
    """Each test starts with no cached checkpoint digest (the cache is per process)."""
    publish.clear_digest_cache()


@pytest.fixture
def base(tmp_path: pathlib.Path) -> pathlib.Path:
    """An empty ``lora_base_dir``."""
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder
