"""Two runs on one resolver folder: a clean-up (``unload(delete_files=True)``) never deletes a folder another
client still uses (it holds a lease on it), and a refused adapter's folder is removed unless someone holds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import lora_sampler
from lora_sampler import SamplerClient
from lora_sampler.testing import FakeEngine, write_adapter_archive


def visible(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir())


def test_unload_delete_files_keeps_a_folder_another_client_uses(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's two sweeps of one run, at the client level: the first one's delete keeps what the second uses."""
    archive = write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as second:
        used = second.publish(archive)
        second.sample([1, 2], adapter=used)
        with SamplerClient(engine.url, lora_base_dir=lora_dir) as first:
            adapter = first.publish(archive)
            assert adapter.name == used.name
            first.unload(adapter, delete_files=True)
        assert (lora_dir / used.name).is_dir()
        assert "another run holds a lease" in caplog.text
        assert second.sample([1, 2], adapter=used).sequences  # still served
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as third:
        third.unload(used.name, delete_files=True)  # nobody holds it now: it goes
    assert visible(lora_dir) == []


def test_a_refused_adapter_folder_is_removed_and_a_client_closing_leaves_no_trace(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """Wrong base model: the folder the publish made is removed again; a closed client leaves no lease file."""
    wrong = write_adapter_archive(tmp_path / "wrong.tar.gz", "other-model")
    good = write_adapter_archive(tmp_path / "good.tar.gz", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(lora_sampler.AdapterConfigError, match="removed again"):
            client.publish(wrong)
        name = client.publish(good).name
        assert visible(lora_dir) == sorted([".leases", name])
    assert visible(lora_dir) == [name]
    assert not os.path.exists(lora_dir / ".leases")
