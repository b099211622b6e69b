"""The CLI's everyday edges: an endpoint URL as base URL, a refused adapter's folder, sampling flags, empty inputs."""

from __future__ import annotations

import ast
import pathlib
from pathlib import Path
from typing import Any, List

import pytest

import lora_sampler
from lora_sampler import SamplerClient, SamplingParams
from lora_sampler._adapters.lease import hold
from lora_sampler._adapters.publish import publish_checkpoint
from lora_sampler.cli import main
from lora_sampler.cli._main import build_parser
from lora_sampler.cli._settings_flags import settings_from
from lora_sampler.testing import FakeEngine, write_adapter_archive


def _sample(engine: FakeEngine, *argv: str) -> List[str]:
    return ["sample", "--base-url", engine.url, *argv, "--quiet"]


def test_cli_base_url_ending_in_an_endpoint_path_says_so(engine: FakeEngine, tmp_path: Path, capsys: Any) -> None:
    """--base-url .../v1/completions stops at once, naming the endpoint path and the root to pass instead."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    argv = ["sample", "--base-url", engine.url + "/v1/completions", "--base-model", engine.model, "--input", str(inp)]
    assert main([*argv, "--output", str(tmp_path / "out.jsonl"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "ends in the endpoint path /v1/completions" in err and repr(engine.url) in err
    assert engine.requests == []
    with pytest.raises(ValueError, match="endpoint path /v1/chat/completions"):
        SamplerClient(engine.url + "/v1/chat/completions/")
    assert SamplerClient(engine.url + "/v1").base_url == engine.url  # the API root itself stays accepted


def test_cli_refused_adapter_published_by_this_run_is_removed(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """An archive for another base model exits 2 and leaves no folder behind in the engine's folder."""
    wrong = write_adapter_archive(tmp_path / "wrong.tar.gz", "other-model")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    argv = _sample(engine, "--lora-base-dir", str(lora_dir), "--adapter", wrong, "--input", str(inp))
    assert main([*argv, "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "base_model_name_or_path='other-model'" in err and "published was removed again" in err
    assert [p.name for p in lora_dir.iterdir() if not p.name.startswith(".")] == []


def test_cli_refused_adapter_folder_from_before_the_run_is_kept(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """A folder another run holds a lease on (an engine of that base model samples it) is not this run's to remove."""
    wrong = write_adapter_archive(tmp_path / "wrong.tar.gz", "other-model")
    other_run = hold(lora_dir, publish_checkpoint(wrong, lora_dir).name)
    before = sorted(p.name for p in lora_dir.iterdir())
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    argv = _sample(engine, "--lora-base-dir", str(lora_dir), "--adapter", wrong, "--input", str(inp))
    assert main([*argv, "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "removed" not in err and "another run holds a lease" in err
    assert sorted(p.name for p in lora_dir.iterdir()) == before
    other_run.release()


def test_cli_sampling_flags_set_every_lines_defaults(capsys: Any) -> None:
    """--top-p, --top-k, --stop (repeatable) and --seed become the lines' SamplingParams; a bad one names its flag."""
    args = build_parser().parse_args(
        [
            *("sample", "--base-url", "http://h", "--input", "x", "--top-p", "0.5", "--top-k", "5", "--seed", "3"),
            *("--stop", "\n", "--stop", "###", "--temperature", "0"),
        ]
    )
    assert settings_from(args, output_dir="-").sampling() == SamplingParams(
        temperature=0, top_p=0.5, top_k=5, seed=3, stop=["\n", "###"]
    )
    bad = build_parser().parse_args(["sample", "--base-url", "http://h", "--input", "x", "--top-p", "2"])
    with pytest.raises(lora_sampler.LoraSamplerError, match=r"--top-p must be a number in \(0, 1\], got 2.0"):
        settings_from(bad, output_dir="-")


@pytest.mark.parametrize("extra", [[], ["--format", "openai-batch"], ["--format", "jsonl"]])
def test_cli_empty_input_is_an_empty_job(engine: FakeEngine, tmp_path: Path, extra: List[str]) -> None:
    """An empty (or all-blank) input file exits 0 with an empty output, in both formats, as vLLM's run-batch."""
    for text in ("", "\n\n"):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(text)
        out.unlink(missing_ok=True)
        assert main(_sample(engine, "--input", str(inp), "--output", str(out), *extra)) == 0
        assert out.read_text() == ""
    assert engine.calls("/v1/completions") == engine.calls("/v1/chat/completions") == 0


def test_user_messages_cite_no_project_document() -> None:
    """No string the package shows (docstrings and comments aside) cites the team's planning notes."""
    found = []
    for path in pathlib.Path(lora_sampler.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            shown = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            if shown and any(word in node.value for word in ("FIND" "INGS", "ROU" "TER.md", "SP" "EC §", "shared/")):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
