"""Fixtures shared by the publishing tests."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture
def base(tmp_path: pathlib.Path) -> pathlib.Path:
    """An empty ``lora_base_dir``."""
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder
