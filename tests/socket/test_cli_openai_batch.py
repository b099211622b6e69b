"""``lora-sampler sample`` with OpenAI batch files and chat lines, against a FakeEngine on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lora_sampler import SamplerClient, SamplingParams
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def engine(engine: FakeEngine, lora_dir: Path) -> FakeEngine:
    """The shared FakeEngine (tests/socket/conftest.py), with the adapter ``step-1`` in its resolver folder."""
    write_adapter(lora_dir / "step-1", engine.model)
    return engine


def batch_line(custom_id: str, model: str, url: str = CHAT, **body: Any) -> Dict[str, Any]:
    text = {"messages": MESSAGES} if url == CHAT else {"prompt": "Once upon"}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **text, **body}}


def write_lines(path: Path, lines: List[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), "utf-8")
    return path


def read_records(path: Path) -> Dict[Any, Dict[str, Any]]:
    records = [json.loads(x) for x in path.read_text("utf-8").splitlines()]
    return {r["custom_id"]: r for r in records}


def run(engine: FakeEngine, lora_dir: Path, inp: Path, out: Path, *more: str) -> int:
    base = ["sample", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--quiet"]
    return main([*base, "--input", str(inp), "--output", str(out), *more])


def test_batch_file_in_both_urls_matches_the_client(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """A batch file (detected by its first line) of chat and completions lines, for an adapter and the base model,
    gives run-batch output lines whose token ids are the client's own."""
    greedy = {"temperature": 0, "max_tokens": 6, "return_token_ids": True}
    lines = [
        batch_line("chat-lora", "step-1", **greedy),
        batch_line("chat-base", engine.model, **greedy),
        batch_line("cmpl-lora", "step-1", COMPLETIONS, **greedy),
        batch_line("cmpl-base", engine.model, COMPLETIONS, **greedy),
    ]
    out = tmp_path / "out.jsonl"
    assert run(engine, lora_dir, write_lines(tmp_path / "in.jsonl", lines), out) == 0
    records = read_records(out)
    assert set(records) == {"chat-lora", "chat-base", "cmpl-lora", "cmpl-base"}
    params = SamplingParams(max_tokens=6, temperature=0)
    with SamplerClient(engine.url) as client:
        expected = {
            "chat-lora": client.chat(MESSAGES, adapter="step-1", sampling_params=params),
            "chat-base": client.chat(MESSAGES, base_model=engine.model, sampling_params=params),
            "cmpl-lora": client.sample("Once upon", adapter="step-1", sampling_params=params),
            "cmpl-base": client.sample("Once upon", base_model=engine.model, sampling_params=params),
        }
    for custom_id, record in records.items():
        assert set(record) == {"id", "custom_id", "response", "error"} and record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        choice = response["body"]["choices"][0]
        assert choice["token_ids"] == list(expected[custom_id].sequences[0].tokens)
        assert choice["finish_reason"] == "length"
        assert ("message" in choice) == custom_id.startswith("chat")
        assert response["body"]["model"] == ("step-1" if custom_id.endswith("lora") else engine.model)


def test_adapter_flag_overrides_body_model(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """--adapter replaces body.model on every line; --format openai-batch forces the format."""
    inp = write_lines(tmp_path / "in.jsonl", [batch_line("a", "not-served"), batch_line("b", "also-not")])
    out = tmp_path / "out.jsonl"
    assert run(engine, lora_dir, inp, out, "--adapter", "step-1", "--format", "openai-batch") == 0
    assert {r["response"]["body"]["model"] for r in read_records(out).values()} == {"step-1"}
    assert engine.calls(CHAT, model="step-1") == 2


def test_resume_is_keyed_by_custom_id(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, capsys: Any
) -> None:
    """A failed custom_id runs again on the next run with the same output; answered ones are not sent again."""
    lines = [batch_line("one", "step-1"), batch_line("two", "late"), batch_line("three", engine.model)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run(engine, lora_dir, inp, out) == 1  # "late" is not on disk yet: vLLM's 404 once the race rows end
    first = read_records(out)
    assert first["two"]["response"]["status_code"] == 404 and first["two"]["error"]["error"]["type"] == "NotFoundError"
    assert "custom_id 'two': HTTP 404: The model `late` does not exist" in capsys.readouterr().err
    assert engine.calls(CHAT, model="late") >= 1  # an unknown bare name is sent and rides the race rows
    answered = first["one"]["response"]["body"]["id"]
    write_adapter(lora_dir / "late", engine.model)
    engine.reset_log()
    assert run(engine, lora_dir, inp, out) == 0
    second = read_records(out)
    assert len(out.read_text("utf-8").splitlines()) == 3 and set(second) == {"one", "two", "three"}
    assert second["two"]["response"]["status_code"] == 200 and second["one"]["response"]["body"]["id"] == answered
    assert engine.calls(CHAT) == 1 and engine.calls(CHAT, model="late") == 1


def test_bad_lines_are_reported_with_their_line_numbers(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """Missing custom_id, an unknown url and a method other than POST: each an error line with its line number;
    the good lines are answered and the exit status is 1."""
    lines: List[Any] = [
        batch_line("good-1", "step-1"),
        {"method": "POST", "url": CHAT, "body": {"model": "step-1", "messages": MESSAGES}},
        {**batch_line("bad-url", "step-1"), "url": "/v1/embeddings"},
        {**batch_line("bad-method", "step-1"), "method": "GET"},
        batch_line("bad-field", "step-1", stream=True),
        batch_line("good-2", engine.model, COMPLETIONS),
    ]
    out = tmp_path / "out.jsonl"
    assert run(engine, lora_dir, write_lines(tmp_path / "in.jsonl", lines), out) == 1
    records = [json.loads(x) for x in out.read_text("utf-8").splitlines()]
    by_line = {r["error"]["line"]: r for r in records if r["error"] is not None}
    assert sorted(by_line) == [2, 3, 4, 5]
    assert by_line[2]["custom_id"] is None and "line 2: the line has no custom_id" in by_line[2]["error"]["message"]
    assert "line 3: url '/v1/embeddings' is not supported" in by_line[3]["error"]["message"]
    assert "line 4: method must be \"POST\", got 'GET'" in by_line[4]["error"]["message"]
    assert "line 5: body.stream=true is not supported" in by_line[5]["error"]["message"]
    assert {r["custom_id"] for r in records if r["error"] is None} == {"good-1", "good-2"}
    err = capsys.readouterr().err
    assert "line 2: the line has no custom_id" in err and "line 4: method must be" in err


def test_plain_lines_take_messages(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """The plain format takes chat lines ({"id", "messages"}) beside prompt lines."""
    lines = [{"id": "c", "messages": MESSAGES}, {"id": "p", "prompt": "hi"}, {"id": "x", "messages": "hi"}]
    out = tmp_path / "out.jsonl"
    inp = write_lines(tmp_path / "in.jsonl", lines)
    assert run(engine, lora_dir, inp, out, "--adapter", "step-1", "--prompt-logprobs") == 1
    records = {r["id"]: r for r in (json.loads(x) for x in out.read_text("utf-8").splitlines())}
    assert records["c"]["sequences"][0]["tokens"] and records["p"]["sequences"][0]["tokens"]
    assert "prompt_logprobs" in records["p"] and "prompt_logprobs" not in records["c"]
    assert "messages must be a list" in records["x"]["error"]["message"]
    assert engine.calls(CHAT) == 1 and engine.calls(COMPLETIONS) == 1


def test_plain_lines_need_a_model_flag(engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any) -> None:
    """Prompt lines name no model, so --adapter or --base-model is required (exit 2, before any request)."""
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert run(engine, lora_dir, inp, tmp_path / "out.jsonl") == 2
    assert "pass --adapter or --base-model" in capsys.readouterr().err
    assert engine.requests == []


def test_a_missing_adapter_does_not_stop_a_file_of_many_models(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Lines name their own model: a run of 404s for one adapter fails those lines only; the others are answered."""
    lines = [batch_line(f"ghost-{n}", "ghost") for n in range(10)] + [batch_line("good", "step-1")]
    out = tmp_path / "out.jsonl"
    assert run(engine, lora_dir, write_lines(tmp_path / "in.jsonl", lines), out, "--ordered") == 1
    records = read_records(out)
    assert len(records) == 11 and records["good"]["response"]["status_code"] == 200
    assert {records[f"ghost-{n}"]["response"]["status_code"] for n in range(10)} == {404}


def test_stdin_is_detected_too(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Batch lines on stdin are detected from the first line; prompt lines on stdin without a model are refused."""
    import io
    import sys

    data = json.dumps(batch_line("s1", "step-1")).encode() + b"\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "out.jsonl"
    base = ["sample", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--quiet", "--input", "-"]
    assert main([*base, "--output", str(out)]) == 0
    assert read_records(out)["s1"]["response"]["status_code"] == 200
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"id": 1, "prompt": "hi"}\n')))
    assert main([*base, "--output", str(tmp_path / "other.jsonl")]) == 2
    assert "pass --adapter or --base-model" in capsys.readouterr().err
    assert engine.calls(COMPLETIONS) == 0
