"""Publishing through the client against the FakeEngine: publish-once, preflight, unload ordering, lineages."""

from __future__ import annotations

import json
import tarfile
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest

import lora_sampler
from lora_sampler import Adapter, SamplerClient, SampleRequest
from lora_sampler.testing import FakeEngine, write_adapter

COMPLETIONS = "/v1/completions"


pytestmark = pytest.mark.usefixtures("no_waits")


@pytest.fixture
def engine_options() -> Dict[str, Any]:
    """Two adapter slots, so lineages and unloads matter."""
    return {"max_loras": 2}


def make_archive(
    tmp_path: Path, stem: str, base_model: str, *, rank: int = 8, suffix: str = ".tar.gz", **config: Any
) -> Path:
    """Build ``<stem><suffix>`` holding ``<stem>/adapter_config.json`` and weights; ``config`` overrides fields."""
    folder = tmp_path / "src" / stem
    write_adapter(folder, base_model, rank=rank)
    if config:
        data = json.loads((folder / "adapter_config.json").read_text())
        data.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(data))
    archive = tmp_path / f"{stem}{suffix}"
    mode = {".tar": "w", ".tar.bz2": "w:bz2", ".tbz2": "w:bz2", ".tar.xz": "w:xz", ".txz": "w:xz"}.get(suffix, "w:gz")
    with tarfile.open(archive, mode) as tar:
        tar.add(folder, arcname=stem)
    return archive


def client_for(engine: FakeEngine, tmp_path: Path) -> SamplerClient:
    return SamplerClient(engine.url, lora_base_dir=tmp_path / "loras")


def test_publish_checkpoint_path_samples_on_first_use(engine: FakeEngine, tmp_path: Path) -> None:
    """adapter=<archive path> publishes once, and the first completion succeeds without a retry."""
    archive = make_archive(tmp_path, "step-400", engine.model)
    with client_for(engine, tmp_path) as client:
        output = client.sample([1, 2], adapter=archive)
        again = client.sample([1, 2], adapter=str(archive))
    assert output.sequences and again.sequences
    published = [p.name for p in (tmp_path / "loras").iterdir()]
    assert len(published) == 1 and published[0].startswith("step-400-")
    assert engine.calls(COMPLETIONS) == 2 and engine.calls("/v1/load_lora_adapter") == 0


@pytest.mark.parametrize("suffix", [".tar.xz", ".tar.bz2", ".txz", ".tbz2"])
def test_publish_bare_archive_name_is_a_checkpoint_path(
    engine: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """adapter="step-400.tar.xz" (no folder in it; bzip2 and short forms too) publishes, not sent as a model name."""
    make_archive(tmp_path, "step-400", engine.model, suffix=suffix)
    monkeypatch.chdir(tmp_path)
    with client_for(engine, tmp_path) as client:
        output = client.sample([1, 2], adapter=f"step-400{suffix}")
    assert output.sequences
    models = {record.model for record in engine.requests if record.path == COMPLETIONS}
    assert len(models) == 1 and str(models.pop()).startswith("step-400-")
    assert engine.calls(COMPLETIONS) == 1


def test_publish_many_threads_publish_once(engine: FakeEngine, tmp_path: Path) -> None:
    """16 concurrent samples of one new archive all succeed and leave exactly one adapter folder."""
    archive = make_archive(tmp_path, "step-1", engine.model)
    with SamplerClient(engine.url, lora_base_dir=tmp_path / "loras", max_workers=16) as client:
        outputs = client.sample_many([SampleRequest([1], adapter=archive)] * 16)
    assert len(outputs) == 16
    assert len(list((tmp_path / "loras").iterdir())) == 1


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"base_model_name_or_path": "other-model"}, "base_model_name_or_path='tiny-base'"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_publish_preflight_refuses_before_any_completion(
    engine: FakeEngine, tmp_path: Path, config: Any, expected: str
) -> None:
    """A wrong base model or peft_type fails with a message naming the fix, and no completion is sent."""
    archive = make_archive(tmp_path, "bad", engine.model, **config)
    with client_for(engine, tmp_path) as client:
        with pytest.raises(lora_sampler.AdapterConfigError) as info:
            client.sample([1], adapter=archive)
    assert expected in str(info.value) and "adapter_config.json" in str(info.value)
    assert engine.calls(COMPLETIONS) == 0


def test_publish_preflight_missing_and_unreadable_config(engine: FakeEngine, tmp_path: Path) -> None:
    """A directory without adapter_config.json, or with broken JSON, is diagnosed before any completion."""
    missing = tmp_path / "src" / "missing"
    missing.mkdir(parents=True)
    (missing / "adapter_model.safetensors").write_bytes(b"x")
    broken = tmp_path / "src" / "broken"
    write_adapter(broken, engine.model)
    (broken / "adapter_config.json").write_text('{"peft_type": "LO')
    with client_for(engine, tmp_path) as client:
        for folder, words in ((missing, "missing"), (broken, "JSON")):
            with pytest.raises(lora_sampler.AdapterConfigError, match=words):
                client.sample([1], adapter=folder)
    assert engine.calls(COMPLETIONS) == 0


def test_publish_unload_then_delete_keeps_the_engine_alive(engine: FakeEngine, tmp_path: Path) -> None:
    """unload(delete_files=True) unloads first, so using other adapters and the old name never kills the engine."""
    with client_for(engine, tmp_path) as client:
        first = client.publish(make_archive(tmp_path, "e1", engine.model))
        client.sample([1], adapter=first)
        client.unload(first, delete_files=True)
        assert not Path(first.path or "").exists()
        for index in range(3):  # more than max_loras: an evicted e1 would be reloaded from disk
            client.sample([1], adapter=client.publish(make_archive(tmp_path, f"other{index}", engine.model)))
        with pytest.raises(lora_sampler.ModelNotFoundError):
            client.sample([1], adapter=first.name)
    assert not engine.is_dead


def test_publish_failed_unload_leaves_the_files(engine: FakeEngine, tmp_path: Path) -> None:
    """When the engine does not confirm the unload (runtime updating off), nothing is deleted."""
    with client_for(engine, tmp_path) as client:
        adapter = client.publish(make_archive(tmp_path, "keep", engine.model))
        client.sample([1], adapter=adapter)
        engine.set_runtime_lora_updating(False)
        with pytest.raises(lora_sampler.EngineStatusError, match="left in place"):
            client.unload(adapter, delete_files=True)
    assert Path(adapter.path or "").is_dir()


def test_publish_unload_of_unknown_name_still_deletes(engine: FakeEngine, tmp_path: Path) -> None:
    """404 "cannot be found" means the engine holds nothing under the name, so the files may go."""
    with client_for(engine, tmp_path) as client:
        adapter = client.publish(make_archive(tmp_path, "never-used", engine.model))
        client.unload(adapter, delete_files=True)
    assert not Path(adapter.path or "").exists()


def _names_unloaded(engine: FakeEngine) -> List[str]:
    return [r.model or "" for r in engine.requests if r.path == "/v1/unload_lora_adapter" and r.status == 200]


def test_publish_lineage_retires_the_previous_adapter(engine: FakeEngine, tmp_path: Path) -> None:
    """Once the newer adapter of a lineage served a request, the older one is unloaded (and deleted if asked)."""
    with client_for(engine, tmp_path) as client:
        old = client.publish(make_archive(tmp_path, "s100", engine.model), lineage="run-17")
        client.sample([1], adapter=old)
        new = client.publish(make_archive(tmp_path, "s200", engine.model), lineage="run-17")
        assert _names_unloaded(engine) == []
        client.sample([1], adapter=new)
    assert _names_unloaded(engine) == [old.name]
    assert Path(old.path or "").is_dir()  # files stay unless asked


def test_publish_lineage_straggler_never_retires_the_newer(engine: FakeEngine, tmp_path: Path) -> None:
    """A slow request for the old adapter delays its retirement and never retires the newer adapter."""
    gate = threading.Event()
    with client_for(engine, tmp_path) as client:
        old = client.publish(make_archive(tmp_path, "s1", engine.model), lineage="run")
        new = client.publish(make_archive(tmp_path, "s2", engine.model), lineage="run")
        client.sample([1], adapter=old)
        while engine.requests_in_flight:  # the engine may still be finishing that answer
            gate.wait(0.01)
        # The straggler's first attempt hangs for 1 s and is dropped; its retry then succeeds.
        engine.inject_fault("hang", model=old.name, seconds=1.0)
        straggler = client.submit([1], adapter=old)
        while engine.requests_in_flight == 0:
            gate.wait(0.01)
        client.sample([1], adapter=new)  # served while the old one is still in flight: old is kept for now
        assert _names_unloaded(engine) == []
        assert straggler.result(timeout=30).sequences
    assert _names_unloaded(engine) == [old.name]


def test_publish_explicit_name_with_other_content_is_an_error(engine: FakeEngine, tmp_path: Path) -> None:
    """Re-using a name for different weights names both digests instead of serving stale weights."""
    from lora_sampler.publish import checkpoint_digest

    first, second = make_archive(tmp_path, "a", engine.model), make_archive(tmp_path, "b", engine.model, rank=4)
    with client_for(engine, tmp_path) as client:
        client.publish(first, name="fixed")
        with pytest.raises(lora_sampler.PublishError) as info:
            client.publish(second, name="fixed")
    assert checkpoint_digest(first) in str(info.value) and checkpoint_digest(second) in str(info.value)


def test_publish_needs_a_resolver_dir(engine: FakeEngine, tmp_path: Path) -> None:
    """Publishing without lora_base_dir is a ValueError that names the missing argument."""
    with SamplerClient(engine.url) as client, pytest.raises(ValueError, match="lora_base_dir"):
        client.publish(make_archive(tmp_path, "x", engine.model))


def test_unload_delete_files_without_a_resolver_dir_is_refused_before_the_unload(engine: FakeEngine) -> None:
    """delete_files=True without lora_base_dir names the missing argument, and the engine is not asked to unload."""
    with SamplerClient(engine.url) as client, pytest.raises(ValueError, match="delete_files=True needs lora_base_dir"):
        client.unload("some-adapter", delete_files=True)
    assert engine.calls("/v1/unload_lora_adapter") == 0


def test_publish_adapter_value_is_accepted(engine: FakeEngine, tmp_path: Path) -> None:
    """An Adapter value samples by its name."""
    with client_for(engine, tmp_path) as client:
        adapter = client.publish(make_archive(tmp_path, "val", engine.model))
        assert isinstance(adapter, Adapter)
        assert client.sample([1], adapter=Adapter(adapter.name)).sequences
