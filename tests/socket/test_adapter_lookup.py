"""Bare adapter names are found before any completion: in lora_base_dir, or on the engine, or one error at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lora_sampler import AdapterNotFoundError, ModelNotFoundError, NotFoundError, RetryEvent, RetryPolicy, SamplerClient
from lora_sampler._adapters.lookup import closest_names, is_slip_of
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

COMPLETIONS = "/v1/completions"


def test_lookup_unpublished_stem_fails_at_once_with_the_content_name(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """adapter="step-400" after publishing step-400.tar.gz raises at once, naming step-400-<digest>; no completion."""
    archive = write_adapter_archive(tmp_path / "runs" / "exp1" / "step-400.tar.gz", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        published = client.publish(archive)
        with pytest.raises(AdapterNotFoundError) as info:
            client.sample("Once upon a time", adapter="step-400")
    error = info.value
    assert isinstance(error, ModelNotFoundError) and isinstance(error, NotFoundError) and error.status_code == 404
    assert error.suggestions == (published.name,)
    assert f"did you mean {published.name!r} (from {archive}, published 0 s ago)?" in str(error)  # source and age
    assert error.attempts == 1 and engine.calls(COMPLETIONS) == 0


def test_lookup_name_served_by_the_engine_but_not_in_the_folder_is_sampled(engine: FakeEngine, tmp_path: Path) -> None:
    """A name the engine lists in GET /v1/models (loaded from elsewhere) is sampled though lora_base_dir lacks it."""
    elsewhere = tmp_path / "elsewhere" / "remote-1"
    write_adapter(elsewhere, engine.model)
    empty = tmp_path / "empty"
    empty.mkdir()
    with SamplerClient(engine.url, lora_base_dir=empty) as client:
        client._transport.post_adapter_command(  # load it the way another client would
            "/v1/load_lora_adapter", "remote-1", {"lora_name": "remote-1", "lora_path": str(elsewhere)}, None, 5.0
        )
        out = client.sample([1, 2, 3], adapter="remote-1")
    assert out.model == "remote-1" and engine.calls(COMPLETIONS) == 1


def test_lookup_without_lora_base_dir_sends_the_name_as_given(engine: FakeEngine, lora_dir: Path) -> None:
    """Without lora_base_dir the engine's own resolver folder may hold the name: it is sent, and resolved there."""
    write_adapter(lora_dir / "step-7", engine.model)
    with SamplerClient(engine.url) as client:
        assert client.sample([1, 2, 3], adapter="step-7").model == "step-7"


def test_lookup_unreachable_models_listing_leaves_the_name_to_the_retries(
    engine: FakeEngine, lora_dir: Path, no_waits: None
) -> None:
    """When GET /v1/models fails, the name is taken as given (the sample's retries deal with the engine)."""
    engine.inject_fault("status", path="/v1/models", status=500, count=1)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(ModelNotFoundError) as info:
            client.sample([1], adapter="never-there")
    assert not isinstance(info.value, AdapterNotFoundError) and engine.calls(COMPLETIONS) == 6


def test_lookup_unknown_name_without_a_content_named_sibling_rides_the_race(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A bare name that no published adapter extends may still be arriving: it is sent and retried until it lands."""
    write_adapter(lora_dir / "step-4-0123456789ab", engine.model)  # a sibling that does not extend the name
    staging = tmp_path / "staging"
    write_adapter(staging, engine.model)

    def land_on_second_retry(event: RetryEvent) -> None:
        if event.attempt == 2:
            staging.rename(lora_dir / "late-arrival")

    with SamplerClient(engine.url, lora_base_dir=lora_dir, retry=RetryPolicy(on_retry=land_on_second_retry)) as client:
        out = client.sample([1, 2, 3], adapter="late-arrival")
    assert out.model == "late-arrival" and engine.calls(COMPLETIONS) == 3


def test_lookup_content_suffix_is_dash_and_hex_digits() -> None:
    """Only `<stem>-<hex digest>` is a content name, whose stem is a slip of it; `<stem>-extra` or `<stem>0` is not."""
    assert is_slip_of("step-4", "step-4-0123456789ab")
    assert not is_slip_of("step-4", "step-4-final")
    assert not is_slip_of("u-1", "u-10")
    assert not is_slip_of("step-4", "step-4-01234")  # five hex digits are no digest


def test_lookup_cli_unknown_adapter_stops_with_one_message(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """`sample --adapter step-400` (published as step-400-<digest>) exits 2 with one line and sends no completion."""
    archive = write_adapter_archive(tmp_path / "step-400.tar.gz", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        name = client.publish(archive).name
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(f'{{"id": {i}, "prompt": "p{i}"}}\n' for i in range(40)), encoding="utf-8")
    argv = ["sample", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter", "step-400"]
    code = main([*argv, "--input", str(inp), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"did you mean {name!r} (from {archive}, published " in err[0]
    assert engine.calls(COMPLETIONS) == 0 and (not out.exists() or out.read_text() == "")


def test_lookup_closest_names_prefer_names_that_extend_the_stem() -> None:
    """The content-named adapter of a stem comes first, then near misses; unrelated names are left out."""
    names = ["step-400-154de9a80e9f", "step-401-aaaaaaaaaaaa", "step-40", "other", "step-400-0123456789ab-x"]
    assert closest_names("step-400", names)[:2] == ["step-400-154de9a80e9f", "step-400-0123456789ab-x"]
    assert "other" not in closest_names("step-400", names)
    assert closest_names("zzz", names) == []
