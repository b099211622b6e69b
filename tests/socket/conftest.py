"""Fixtures shared by the socket tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    """The engine's resolver folder (empty)."""
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder
