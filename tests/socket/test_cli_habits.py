"""The command line with the habits of run-batch and lm-eval users: -i/-o, --limit N, --extra-body JSON, a pipe
closed early (``| head -1``), and help texts that show only what applies.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest
from test_cli import ids, subprocess_env

from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine

COMPLETIONS = "/v1/completions"


def _prompts(path: Path, count: int, **extra: Any) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": [5, 6], **extra}) + "\n" for i in range(count)))
    return path


def _base(engine: FakeEngine) -> List[str]:
    return ["--base-url", engine.url, "--base-model", engine.model, "--quiet"]


def test_short_input_and_output_flags(engine: FakeEngine, tmp_path: Path) -> None:
    """-i and -o are --input and --output, for sample and score alike."""
    inp = _prompts(tmp_path / "in.jsonl", 3)
    assert main(["sample", *_base(engine), "-i", str(inp), "-o", str(tmp_path / "s.jsonl")]) == 0
    assert main(["score", *_base(engine), "-i", str(inp), "-o", str(tmp_path / "c.jsonl")]) == 0
    assert ids(tmp_path / "s.jsonl") and sorted(ids(tmp_path / "c.jsonl")) == [0, 1, 2]


def prompts_sent(engine: FakeEngine) -> int:
    """The prompts the engine's completions held (a request may hold several)."""
    return sum(record.prompts for record in engine.requests if record.path == COMPLETIONS)


def test_limit_runs_the_first_lines_and_resumes_on_the_same_lines(engine: FakeEngine, tmp_path: Path) -> None:
    """--limit 4 runs lines 0-3 (blank lines not counted); the same command again sends nothing; --limit 6 adds two."""
    inp = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "prompt": [5]}) for i in range(10)]
    inp.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["sample", *_base(engine), "-i", str(inp), "-o", str(out)]
    # Prompts sent, not requests: several lines may go in one request, as many as were ready together.
    assert main([*argv, "--limit", "4"]) == 0
    assert sorted(ids(out)) == [0, 1, 2, 3] and prompts_sent(engine) == 4
    engine.reset_log()
    assert main([*argv, "--limit", "4"]) == 0 and prompts_sent(engine) == 0
    assert main([*argv, "--limit", "6"]) == 0 and sorted(ids(out)) == [0, 1, 2, 3, 4, 5]
    assert prompts_sent(engine) == 2
    assert main([*argv, "--limit", "0"]) == 2  # a usage error, not an empty run


def test_extra_body_reaches_the_engine_and_a_line_overrides_it(engine: FakeEngine, tmp_path: Path) -> None:
    """--extra-body JSON goes into every request; a line's own extra_body object wins for its keys."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"id": "a", "prompt": [5]})
        + "\n"
        + json.dumps({"id": "b", "prompt": [5], "extra_body": {"min_tokens": 2, "ignore_eos": True}})
        + "\n"
    )
    extra = '{"min_tokens": 1, "repetition_penalty": 1.1}'
    argv = ["sample", *_base(engine), "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--ordered"]
    assert main([*argv, "--extra-body", extra]) == 0
    sent = [dict(r.extra_fields) for r in engine.requests if r.path == COMPLETIONS]
    # The two lines are sent concurrently: the engine may see them in either order.
    assert sorted(sent, key=lambda fields: fields["min_tokens"]) == [
        {"min_tokens": 1, "repetition_penalty": 1.1},
        {"min_tokens": 2, "repetition_penalty": 1.1, "ignore_eos": True},
    ]


@pytest.mark.parametrize(
    "value, problem",
    [
        ("{", "JSON object"),
        ('{"n": 2}', "use --num-samples"),
        ("[1]", "dict"),
        ("null", "dict"),
        ('{"min_p": NaN}', "NaN, which is not JSON"),
        ('{"x": [-Infinity]}', "-Infinity, which is not JSON"),
    ],
)
def test_extra_body_refuses_what_cannot_be_sent(
    engine: FakeEngine, tmp_path: Path, value: str, problem: str, capsys: Any
) -> None:
    """Bad JSON, a field the request sets itself, or not an object: a usage error naming the fix, nothing sent.

    NaN and Infinity (Python's extension of JSON) are refused as the flag is read: no request could carry them, so
    every line failed with the encoder's "Out of range float values are not JSON compliant".
    """
    inp = _prompts(tmp_path / "in.jsonl", 1)
    assert main(["sample", *_base(engine), "-i", str(inp), "--extra-body", value]) == 2
    assert problem in capsys.readouterr().err and engine.requests == []


def test_closed_pipe_stops_quietly(engine: FakeEngine, tmp_path: Path) -> None:
    """`lora-sampler sample ... | head -1`: exit 141 (as SIGPIPE), stderr empty (not "free some space")."""
    inp = _prompts(tmp_path / "in.jsonl", 300)
    argv = [sys.executable, "-m", "lora_sampler", "sample", *_base(engine), "-i", str(inp), "--ordered"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = json.loads(proc.stdout.readline())
        proc.stdout.close()  # what head does after its line
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first["id"] == 0
    assert code == 141 and err == "", err


def test_help_shows_only_what_applies(capsys: Any) -> None:
    """--max-adapter-gib only where checkpoints are published; no tests-only variable; --window explained."""
    helps = {}
    for name in ("", "sample", "score", "sweep", "publish", "unload", "doctor"):
        assert main([name, "--help"] if name else ["--help"]) == 0
        helps[name] = " ".join(capsys.readouterr().out.split())
    for name in ("unload", "doctor"):
        assert "--max-adapter-gib" not in helps[name], name
    for name in ("sample", "score", "sweep", "publish"):
        assert "--max-adapter-gib" in helps[name], name
    assert "LORA_SAMPLER_TESTING" not in "".join(helps.values())
    assert "VLLM_API_KEY" in helps[""] and "does not idle" in helps["sweep"]
    # Python 3.13's argparse names the metavar once ("-i, --input INPUT"); earlier ones twice.
    assert re.search(r"-i( INPUT)?, --input INPUT", helps["sample"]), helps["sample"]
    assert re.search(r"-o( OUTPUT)?, --output OUTPUT", helps["score"]), helps["score"]
    assert "--limit N" in helps["sample"] and "--extra-body JSON" in helps["sweep"]
