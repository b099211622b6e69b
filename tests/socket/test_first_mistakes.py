"""A newcomer's first mistakes: a mistyped adapter name fails at once with a "did you mean" that tells look-alikes
apart (source checkpoint and age), while a name that may still be arriving rides the load race as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, List

import pytest

from lora_sampler import AdapterNotFoundError, RetryEvent, RetryPolicy, SamplerClient
from lora_sampler._adapters.lookup import is_slip_of
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

COMPLETIONS = "/v1/completions"


def _publish_runs(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> List[str]:
    """Two training runs' step-400 (different weights) and a step-4000: three look-alike content names."""
    names = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        for run, step, rank in (("exp1", 400, 2), ("exp2", 400, 3), ("exp1", 4000, 4)):
            archive = write_adapter_archive(tmp_path / run / f"step-{step}.tar.gz", engine.model, rank=rank)
            names.append(client.publish(archive).name)
    old = time.time() - 3 * 3600  # exp1's step-400 was published three hours ago
    os.utime(lora_dir / names[0] / ".lora_sampler.json", (old, old))
    return names


@pytest.mark.parametrize("typo", ["step-40", "stpe-400", "step-400-{digest}x", "step-400-{short}"])
def test_mistyped_name_fails_at_once_with_sources_and_ages(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, typo: str
) -> None:
    """step-40, a swapped letter, a mistyped or cut digest: AdapterNotFoundError before any completion, naming the
    look-alikes with their checkpoints and ages (the two runs' step-400 are told apart)."""
    names = _publish_runs(engine, lora_dir, tmp_path)
    digest = names[0].rsplit("-", 1)[1]
    name = typo.format(digest=digest[:-1], short=digest[:6])
    engine.reset_log()
    started = time.monotonic()
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(AdapterNotFoundError) as caught:
            client.sample([1, 2], adapter=name)
    assert time.monotonic() - started < 5  # no retry table (its waits add about 4 s)
    message = str(caught.value)
    assert engine.calls(COMPLETIONS) == 0 and caught.value.attempts == 1
    assert names[0] in caught.value.suggestions
    assert f"{names[0]!r} (from {tmp_path / 'exp1' / 'step-400.tar.gz'}, published 3 h ago)" in message
    if "-" not in typo[len("step-400") :]:  # a stem: both runs' step-400 are named, each with its own source
        assert f"{names[1]!r} (from {tmp_path / 'exp2' / 'step-400.tar.gz'}, published " in message


def test_cli_mistyped_adapter_exits_at_once_with_one_line(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """`sample --adapter step-40`: exit 2, one stderr line with the "did you mean", no completion, no output row."""
    names = _publish_runs(engine, lora_dir, tmp_path)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(f'{{"id": {i}, "prompt": "p{i}"}}\n' for i in range(100)), encoding="utf-8")
    engine.reset_log()
    argv = ["sample", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter", "step-40"]
    code = main([*argv, "--input", str(inp), "--output", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "did you mean" in err[0] and names[0] in err[0], err
    assert engine.calls(COMPLETIONS) == 0 and not out.exists()


def test_new_content_name_still_rides_the_race(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """step-400-<another digest> (the checkpoint's new content, another process publishing it) is sent and retried
    until it lands: a new digest is not a slip of the old one."""
    names = _publish_runs(engine, lora_dir, tmp_path)
    arriving = names[0].rsplit("-", 1)[0] + "-0123456789ab"
    assert not is_slip_of(arriving, names[0])
    staging = tmp_path / "staging"
    write_adapter(staging, engine.model)

    def land_on_second_retry(event: RetryEvent) -> None:
        if event.attempt == 2:
            staging.rename(lora_dir / arriving)

    with SamplerClient(engine.url, lora_base_dir=lora_dir, retry=RetryPolicy(on_retry=land_on_second_retry)) as client:
        assert client.sample([1, 2, 3], adapter=arriving).model == arriving


@pytest.mark.parametrize(
    "name, candidate, slip",
    [
        ("step-400", "step-400-154de9a80e9f", True),
        ("step-40", "step-400-154de9a80e9f", True),
        ("step-4000", "step-400-154de9a80e9f", True),
        ("step-400-154de9a80e9", "step-400-154de9a80e9f", True),
        ("step-400-154de9a8", "step-400-154de9a80e9f", True),
        ("step-400-1", "step-400-154de9a80e9f", False),
        ("step-400-0123456789ab", "step-400-154de9a80e9f", False),
        ("step-500-154de9a80e9f", "step-400-154de9a80e9f", False),
        ("parity-real-12-a1b2c3", "parity-real-11-d4e5f6", False),
        ("u-1", "u-10-abcdef", False),
        ("late-arrival", "step-4-0123456789ab", False),
        ("step-400-154de9a80e9f", "step-400-154de9a80e9f", False),
        ("step-400", "step-400", False),
    ],
)
def test_slip_rule(name: str, candidate: str, slip: bool) -> None:
    """A slip: the stem, the stem 1-2 characters off, the digest cut or 1-2 characters off; never another digest."""
    assert is_slip_of(name, candidate) is slip


def test_cli_prints_each_distinct_error_once_with_a_count(engine: FakeEngine, tmp_path: Path, capsys: Any) -> None:
    """29 lines failing alike and one failing otherwise: three stderr lines (two errors, one count), not 30."""
    engine.inject_fault("status", count=29, status=400, message="engine overloaded in shard 7")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [f'{{"id": {i}, "prompt": [5, 6]}}\n' for i in range(29)] + [f'{{"id": "long", "prompt": {[5] * 300}}}\n']
    inp.write_text("".join(lines), encoding="utf-8")
    argv = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--concurrency", "1", "--ordered"]
    argv += ["--prompts-per-request", "1"]  # the scripted 400s answer one line each
    code = main([*argv, "--input", str(inp), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(out.read_text().splitlines()) == 30
    assert len(err) == 3, err
    assert "line 1 (id 0)" in err[0] and "engine overloaded" in err[0]
    assert "id 'long'" in err[1] and "maximum context length" in err[1]
    assert err[2].startswith("lora-sampler: 29 lines failed with the same error as line 1 (id 0)")
