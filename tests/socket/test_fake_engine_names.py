"""What ``FakeEngine.set_visibility_delay`` takes for a name: an adapter folder or a checkpoint's stem, never an
archive (every suffix publishing reads, in any letter case: ``lora_sampler._wire.archives``) nor a path."""

from __future__ import annotations

import pytest

from lora_sampler._wire.archives import ARCHIVE_SUFFIXES
from lora_sampler.testing import FakeEngine


@pytest.mark.parametrize("name", ["step-1", "step-1-154de9a80e9f", "step-1.tar.gz.d", "tarball", "step.targz"])
def test_visibility_delay_takes_folder_names_and_stems(engine: FakeEngine, name: str) -> None:
    """A folder name or stem is taken, also one that merely contains an archive suffix."""
    engine.set_visibility_delay(name, requests=1)


@pytest.mark.parametrize("suffix", [*ARCHIVE_SUFFIXES, ".TAR.GZ", ".Tgz", ".TXZ"])
def test_visibility_delay_refuses_every_archive_name(engine: FakeEngine, suffix: str) -> None:
    """Every archive suffix publishing reads is refused, whatever its case: a delay names the folder publishing
    makes, not the archive it comes from."""
    with pytest.raises(ValueError, match="takes an adapter name"):
        engine.set_visibility_delay(f"step-1{suffix}", requests=1)


@pytest.mark.parametrize("name", ["", ".", "..", "run/step-1"])
def test_visibility_delay_refuses_paths(engine: FakeEngine, name: str) -> None:
    """An empty name, a dot folder or a path is refused."""
    with pytest.raises(ValueError, match="takes an adapter name"):
        engine.set_visibility_delay(name, seconds=1.0)
