"""A field a JSONL line does not take is an error row naming it with a "did you mean"; ``metadata`` is the user's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lora_sampler.batch._lines import LineDefaults, parse_line
from lora_sampler.batch._score import parse_score_line
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine


def _records(path: Path) -> Dict[Any, Dict[str, Any]]:
    return {record["id"]: record for record in map(json.loads, path.read_text().splitlines())}


def _write(path: Path, lines: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("field", "hint"),
    [
        ("temprature", "did you mean 'temperature'"),
        ("n", "num_samples"),
        ("max_new_tokens", "max_tokens"),
        ("model", "--adapter"),
        ("promt", "did you mean 'prompt'"),
    ],
)
def test_sample_line_with_an_unknown_field_is_an_error_row_naming_it(field: str, hint: str) -> None:
    """An unknown key of a prompt line is the line's error, naming the key and what to write instead."""
    line = parse_line(json.dumps({"id": 1, "prompt": [1, 2], field: 3}).encode(), 1, LineDefaults())
    assert line is not None and line.request is None
    assert repr(field) in line.error and hint in line.error and "metadata" in line.error


def test_score_line_with_an_unknown_field_is_an_error_row_naming_it() -> None:
    """A scoring line refuses an unknown key the same way (``completon`` -> ``completion``)."""
    line = parse_score_line(json.dumps({"prompt": [1, 2], "completon": [3]}).encode(), 1, LineDefaults())
    assert line is not None and line.request is None and "did you mean 'completion'" in line.error


def test_cli_sample_unknown_fields_fail_their_rows_and_metadata_reaches_the_output(
    engine: FakeEngine, tmp_path: Path, capsys: Any
) -> None:
    """`temprature` fails its own line (exit 1) where it was ignored; a line's metadata is copied to its row."""
    inp = _write(
        tmp_path / "in.jsonl",
        [
            {"id": "typo", "prompt": [1, 2], "temprature": 0},
            {"id": "ok", "prompt": [1, 2], "metadata": {"split": "dev", "n": 3}},
        ],
    )
    out = tmp_path / "out.jsonl"
    argv = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp)]
    assert main([*argv, "--output", str(out), "--quiet"]) == 1
    records = _records(out)
    assert "temprature" in records["typo"]["error"]["message"] and "sequences" not in records["typo"]
    assert records["ok"]["metadata"] == {"split": "dev", "n": 3} and records["ok"]["sequences"]
    assert "did you mean 'temperature'" in capsys.readouterr().err


def test_cli_score_metadata_reaches_the_row_and_the_error_row(engine: FakeEngine, tmp_path: Path) -> None:
    """Scoring rows carry the line's metadata too, answered or failed."""
    inp = _write(
        tmp_path / "in.jsonl",
        [{"id": 1, "prompt": [1, 2, 3], "metadata": "a"}, {"id": 2, "prompt": [], "metadata": ["b"]}],
    )
    out = tmp_path / "out.jsonl"
    argv = ["score", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp)]
    main([*argv, "--output", str(out), "--quiet"])
    records = _records(out)
    assert records[1]["metadata"] == "a" and "sum" in records[1]
    assert records[2]["metadata"] == ["b"] and "error" in records[2]
