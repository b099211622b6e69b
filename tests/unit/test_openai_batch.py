"""The OpenAI batch file format: line parsing, body fields, output lines and the resume key."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict

import pytest
import requests

from lora_sampler.batch import InputLine, LineDefaults, prepare_output, read_input
from lora_sampler.errors import EngineConnectionError, EngineStatusError
from lora_sampler.openai_batch import (
    OPENAI_BATCH_FORMAT,
    PROMPT_FORMAT,
    batch_error_record,
    batch_record_key,
    batch_result_record,
    detect_format,
    parse_batch_line,
)
from lora_sampler.types import GeneratedSequence, SampleOutput, SamplingParams

DEFAULTS = LineDefaults(sampling_params=SamplingParams(max_tokens=16, temperature=1.0))
MESSAGES = [{"role": "user", "content": "Hi"}]


def line(body: Dict[str, Any], url: str = "/v1/chat/completions", **top: Any) -> bytes:
    obj = {"custom_id": "c1", "method": "POST", "url": url, "body": body, **top}
    return json.dumps(obj).encode() + b"\n"


def parse(raw: bytes, number: int = 3, defaults: LineDefaults = DEFAULTS) -> InputLine:
    parsed = parse_batch_line(raw, number, defaults)
    assert parsed is not None
    return parsed


def test_chat_line_becomes_a_chat_request_with_every_body_field() -> None:
    """A chat line's body reaches the payload: sampling fields as SamplingParams, the rest as given."""
    body = {
        "model": "step-1",
        "messages": MESSAGES,
        "max_completion_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 4,
        "stop": "\n",
        "stop_token_ids": [2],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
        "repetition_penalty": 1.1,
        "user": "eval",
    }
    parsed = parse(line(body))
    assert parsed.id == "c1" and parsed.error == "" and parsed.request is not None
    assert parsed.request.is_chat and parsed.request.adapter == "step-1"
    payload = parsed.request.to_payload("step-1")
    assert payload["messages"] == MESSAGES and payload["n"] == 2
    assert (payload["max_tokens"], payload["temperature"], payload["top_p"], payload["seed"]) == (7, 0, 0.5, 4)
    assert payload["stop"] == ["\n"] and payload["stop_token_ids"] == [2]
    assert payload["top_logprobs"] == 3 and payload["repetition_penalty"] == 1.1 and payload["user"] == "eval"
    assert payload["logprobs"] is True and payload["return_token_ids"] is True
    assert set(body) - {"max_completion_tokens"} <= set(payload)  # it went in as max_tokens


def test_completions_line_becomes_a_prompt_request() -> None:
    """A completions line samples its prompt; prompt_logprobs k is the top-k prompt logprobs."""
    parsed = parse(line({"model": "a", "prompt": [5, 6], "max_tokens": 3, "prompt_logprobs": 2}, "/v1/completions"))
    assert parsed.request is not None and not parsed.request.is_chat
    payload = parsed.request.to_payload("a")
    assert payload["prompt"] == [5, 6] and payload["max_tokens"] == 3 and payload["prompt_logprobs"] == 2


def test_body_model_is_the_base_model_when_the_engine_serves_it() -> None:
    """body.model names a base model when the engine serves one of that name, else an adapter."""
    serving = LineDefaults(base_models=("tiny",))
    base = parse(line({"model": "tiny", "messages": MESSAGES}), defaults=serving)
    adapter = parse(line({"model": "lora-1", "messages": MESSAGES}), defaults=serving)
    assert base.request is not None and base.request.base_model == "tiny" and base.request.adapter is None
    assert adapter.request is not None and adapter.request.adapter == "lora-1"


def test_an_explicit_adapter_overrides_body_model() -> None:
    """--adapter (the defaults' adapter) replaces body.model on every line."""
    defaults = LineDefaults(adapter="forced", sampling_params=SamplingParams())
    parsed = parse(line({"model": "other", "messages": MESSAGES}), defaults=defaults)
    assert parsed.request is not None and parsed.request.adapter == "forced"
    assert parsed.request.to_payload("forced")["model"] == "forced"


def test_omitted_fields_take_the_defaults() -> None:
    """Fields the body leaves out (or sets to null) take the line defaults (the CLI flags)."""
    parsed = parse(line({"model": "a", "messages": MESSAGES, "temperature": None}))
    assert parsed.request is not None and parsed.request.sampling_params == DEFAULTS.sampling_params


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        (b'{"method": "POST", "url": "/v1/completions", "body": {}}', "has no custom_id"),
        (line({"model": "a", "messages": MESSAGES}, custom_id=5), "has custom_id 5"),
        (line({"model": "a", "messages": MESSAGES}, method="GET"), "method must be \"POST\", got 'GET'"),
        (line({"model": "a", "input": "x"}, "/v1/embeddings"), "url '/v1/embeddings' is not supported"),
        (line({"model": "a", "messages": MESSAGES}, extra=1), "unknown key 'extra'"),
        (line({"messages": MESSAGES}), "body.model must name the adapter"),
        (line({"model": "a", "prompt": "x"}), "body.prompt does not belong in a /v1/chat/completions line"),
        (line({"model": "a", "messages": MESSAGES}, "/v1/completions"), "body.messages does not belong"),
        (line({"model": "a"}), "body.messages is missing"),
        (line({"model": "a", "messages": [{"role": "bot", "content": "x"}]}), "body.messages[0] has role 'bot'"),
        (line({"model": "a", "messages": MESSAGES, "stream": True}), "body.stream=true is not supported"),
        (line({"model": "a", "messages": MESSAGES, "n": 0}), "body.n must be an integer >= 1"),
        (line({"model": "a", "messages": MESSAGES, "max_tokens": 0}), "body: max_tokens must be an int >= 1"),
        (line({"model": "a", "messages": MESSAGES, "return_token_ids": False}), "body.return_token_ids=false"),
        (line({"model": "a", "prompt": "x", "logprobs": 5}, "/v1/completions"), "body.logprobs=5 is not supported"),
        (line({"model": "a", "messages": MESSAGES, "prompt_logprobs": 1}), "body.prompt_logprobs=1 is not"),
        (line({"model": "a", "prompt": "x", "max_completion_tokens": 3}, "/v1/completions"), "belongs to chat"),
    ],
)
def test_bad_lines_are_reported_with_the_field(raw: bytes, phrase: str) -> None:
    """Each bad line becomes an error naming the field (the record adds the line number); nothing raises."""
    parsed = parse(raw, 7)
    assert parsed.request is None and phrase in parsed.error, parsed.error
    record = batch_error_record(parsed, parsed.error)
    assert record["error"]["message"].startswith("line 7: ") and record["error"]["line"] == 7
    assert record["response"] is None


def test_missing_custom_id_is_written_with_a_null_custom_id() -> None:
    """A line without custom_id still gets an output line (custom_id null), so nothing is lost silently."""
    parsed = parse(b'{"method": "POST", "url": "/v1/completions", "body": {}}', 2)
    record = batch_error_record(parsed, parsed.error)
    assert record["custom_id"] is None and "line 2: the line has no custom_id" in record["error"]["message"]


def test_read_input_reports_a_repeated_custom_id_with_both_lines() -> None:
    """Two lines with one custom_id stop the run, naming both line numbers."""
    data = line({"model": "a", "messages": MESSAGES}) * 2
    with pytest.raises(ValueError, match="line 2 repeats the id 'c1' of line 1"):
        list(read_input(io.BytesIO(data), DEFAULTS, name="in.jsonl", parse=parse_batch_line))


def test_detect_format_reads_the_first_non_blank_line_and_replays_everything() -> None:
    """The format comes from the first non-blank line; no line is consumed."""
    batch = [b"\n", line({"model": "a", "messages": MESSAGES}), b"x\n"]
    found, lines = detect_format(iter(batch))
    assert found == OPENAI_BATCH_FORMAT and list(lines) == batch
    found, lines = detect_format(iter([b'{"id": 1, "prompt": "x"}\n']))
    assert found == PROMPT_FORMAT and len(list(lines)) == 1
    assert detect_format(iter([]))[0] == PROMPT_FORMAT


def _status_error(status: int, body: Dict[str, Any]) -> EngineStatusError:
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps(body).encode()
    response.url = "http://127.0.0.1:9/v1/chat/completions"
    response.headers["Content-Type"] = "application/json"
    return EngineStatusError.from_response(response, model="a", adapter=True)


def test_output_lines_have_the_run_batch_shape() -> None:
    """Answered: status 200 and the engine's body; refused: its status and error body; no answer: response null."""
    parsed = parse(line({"model": "a", "messages": MESSAGES}))
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}
    output = SampleOutput((GeneratedSequence((1,), (-0.5,), "length"),), model="a", body=body)
    ok = batch_result_record(parsed, output)
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": body}
    engine_body = {"error": {"message": "The model `a` does not exist.", "type": "NotFoundError", "param": "model"}}
    refused = batch_error_record(parsed, _status_error(404, engine_body))
    assert refused["response"]["status_code"] == 404 and refused["response"]["body"] is None
    assert refused["error"] == engine_body and refused["custom_id"] == "c1"
    down = batch_error_record(parsed, EngineConnectionError("refused", model="a"))
    assert down["response"] is None and down["error"]["type"] == "EngineConnectionError"
    assert batch_record_key(ok) == ('"c1"', False)
    assert batch_record_key(refused) == ('"c1"', True) and batch_record_key(down) == ('"c1"', True)
    assert batch_record_key({"id": "x", "sequences": []}) is None


def test_resume_keeps_answered_custom_ids_and_drops_failed_ones(tmp_path: Path) -> None:
    """prepare_output with the batch key: answered custom_ids are done, failures and keyless errors run again."""
    parsed = parse(line({"model": "a", "messages": MESSAGES}))
    ok = batch_result_record(parsed, SampleOutput((), model="a", body={"id": "x"}))
    bad = parse(b'{"method": "POST", "url": "/v1/completions", "body": {}}', 2)
    failed = {**ok, "custom_id": "c2", "response": None, "error": {"message": "down"}}
    path = tmp_path / "out.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in (ok, failed, batch_error_record(bad, bad.error))) + '{"torn', "utf-8"
    )
    state = prepare_output(str(path), key_of=batch_record_key)
    assert state.done == {'"c1"'} and state.dropped_errors == 2 and state.dropped_torn == 1
    assert [json.loads(x)["custom_id"] for x in path.read_text("utf-8").splitlines()] == ["c1"]


def test_detect_format_skips_a_byte_order_mark() -> None:
    """A batch file saved with a UTF-8 BOM is still recognised (read_input skips the BOM too)."""
    found, _ = detect_format(iter([b"\xef\xbb\xbf" + line({"model": "a", "messages": MESSAGES})]))
    assert found == OPENAI_BATCH_FORMAT
