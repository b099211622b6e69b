"""A checkpoint published into a folder the engine does not watch: once the race gives up, the error names that
folder, says the engine may not watch it (its VLLM_LORA_RESOLVER_CACHE_DIR) and points to `lora-sampler doctor`.

Before, it said "check that the adapter is published in the engine's resolver directory" without naming the folder
the client had published into, so the user could not tell which of the two folders was wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lora_sampler import ModelNotFoundError, SamplerClient
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter


@pytest.fixture
def unwatched(tmp_path: Path, make_engine: Any) -> Any:
    """An engine watching ``watched/`` (runtime loading off), a folder it does not watch, and a checkpoint."""
    engine: FakeEngine = make_engine(lora_dir=tmp_path / "watched", runtime_lora_updating=False)
    other = tmp_path / "not-watched"
    other.mkdir()
    checkpoint = write_adapter(tmp_path / "step-100", engine.model)
    return engine, other, checkpoint


def test_a_published_adapter_the_engine_never_serves_names_the_folder(unwatched: Any, no_waits: None) -> None:
    """The race's give-up (its attempts unchanged) names lora_base_dir, the resolver variable and doctor."""
    engine, other, checkpoint = unwatched
    with SamplerClient(engine.url, lora_base_dir=other) as client:
        with pytest.raises(ModelNotFoundError) as caught:
            client.sample([1, 2], adapter=checkpoint, max_tokens=2)
    message = str(caught.value)
    assert caught.value.attempts == 6, caught.value.attempts
    assert f"lora_base_dir {other}" in message, message
    assert "VLLM_LORA_RESOLVER_CACHE_DIR" in message and "lora-sampler doctor" in message, message
    assert caught.value.status == 404 and caught.value.adapter, caught.value


def test_the_cli_row_names_the_folder_too(unwatched: Any, no_waits: None, tmp_path: Path) -> None:
    """`sample --lora-base-dir` writes the same words into each failed line's error row."""
    engine, other, checkpoint = unwatched
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": [1, 2], "max_tokens": 2}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    argv = ["sample", "--base-url", engine.url, "--lora-base-dir", str(other), "--adapter", str(checkpoint)]
    status = main([*argv, "--input", str(prompts), "--output", str(out), "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert status == 1 and len(rows) == 3, (status, rows)
    for row in rows:
        assert str(other) in row["error"]["message"] and "lora-sampler doctor" in row["error"]["message"], row


def test_an_adapter_name_without_a_folder_keeps_the_plain_hint(make_engine: Any, no_waits: None) -> None:
    """An adapter name sent without lora_base_dir (nothing published) names no folder it does not know."""
    engine: FakeEngine = make_engine(runtime_lora_updating=False)
    with SamplerClient(engine.url) as client:
        with pytest.raises(ModelNotFoundError) as caught:
            client.sample([1, 2], adapter="never-published", max_tokens=2)
    assert "lora_base_dir" not in str(caught.value) and "lora-sampler doctor" in str(caught.value)


def test_the_folder_as_the_engine_sees_it_is_named_too(unwatched: Any, no_waits: None) -> None:
    """With engine_lora_base_dir (the engine sees the folder under another path), both paths are named."""
    engine, other, checkpoint = unwatched
    with SamplerClient(engine.url, lora_base_dir=other, engine_lora_base_dir="/mnt/engine-loras") as client:
        with pytest.raises(ModelNotFoundError) as caught:
            client.sample([1, 2], adapter=checkpoint, max_tokens=2)
    message = str(caught.value)
    assert f"lora_base_dir {other} (sent to the engine as /mnt/engine-loras)" in message, message
