"""Issue 23's echoed secrets: an engine that echoes request headers never gets a key or a password anywhere.

A raw loopback server answers health and models like vLLM and refuses every completion with a 400 whose body
echoes the request's headers (as some proxies' error pages do).
"""

from __future__ import annotations

import base64
import json
import pickle
import socket
from pathlib import Path
from typing import Any, Callable, List

import pytest
from rawserver import RawServer

from lora_sampler import EngineStatusError, RetryEvent, RetryPolicy, SamplerClient
from lora_sampler.cli import main

KEY = "sk-echo-5b1e2c9d"
PASSWORD = "pw-echo-77aa"
PROMPT = "a private prompt 41d3"


def echoing_engine(
    server_box: List[RawServer], status: str = "400 Bad Request"
) -> Callable[[socket.socket, int], None]:
    """Health 200, one base model ``m``, and every other request refused with its own headers in the body."""

    def handler(conn: socket.socket, index: int) -> None:
        request = server_box[0].requests[-1]
        line = request.split(b"\r\n", 1)[0]
        if b" /health " in line:
            body, code = b"", "200 OK"
        elif b" /v1/models " in line:
            body, code = json.dumps({"data": [{"id": "m", "root": "m"}]}).encode(), "200 OK"
        else:
            echoed = request.split(b"\r\n\r\n", 1)[0].decode("latin-1")
            body, code = json.dumps({"error": {"message": f"bad request; you sent {echoed}"}}).encode(), status
        head = f"HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        conn.sendall((head + "Connection: close\r\n\r\n").encode() + body)

    return handler


def secrets_in(text: str) -> List[str]:
    """The secrets (and their base64 forms) that appear in ``text``."""
    forms = [KEY, PASSWORD, base64.b64encode(f"alice:{PASSWORD}".encode()).decode(), base64.b64encode(KEY.encode())]
    return [form for form in map(str, forms) if form in text]


def test_hostile_openai_batch_output_and_stderr_never_hold_an_echoed_key(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine echoing the request headers in a 400: the batch output file and stderr hold no key."""
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", KEY)
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    box: List[RawServer] = []
    with RawServer(echoing_engine(box)) as server:
        box.append(server)
        assert main(["sample", "--base-url", server.url, "--input", str(inp), "--output", str(out), "--quiet"]) == 1
        assert "Bearer" in server.requests[-1].decode("latin-1")  # the key was sent, and echoed
    record = json.loads(out.read_text())
    assert record["response"]["status_code"] == 400 and "you sent" in json.dumps(record)
    assert secrets_in(out.read_text()) == [] and secrets_in(capsys.readouterr().err) == []


def test_hostile_echoed_basic_auth_is_redacted_from_str_repr_and_pickle() -> None:
    """An echoed ``Authorization: Basic <base64 of user:password>`` is in no str, repr or pickle of the error."""
    box: List[RawServer] = []
    with RawServer(echoing_engine(box)) as server:
        box.append(server)
        url = server.url.replace("http://", f"http://alice:{PASSWORD}@")
        with SamplerClient(url, retry=RetryPolicy(max_attempts=1)) as client:
            with pytest.raises(EngineStatusError) as info:
                client.sample(PROMPT, base_model="m")
        assert "Authorization: Basic" in server.requests[-1].decode("latin-1")
    error = info.value
    assert "Basic ***" in str(error)
    for text in (str(error), repr(error), repr(pickle.loads(pickle.dumps(error)).__dict__), error.response.text):
        assert secrets_in(text) == []


def test_hostile_retry_hooks_reach_neither_the_key_nor_the_prompt(no_waits: None) -> None:
    """``on_retry`` hooks get a cause whose response's request holds no Authorization header and no body."""
    events: List[RetryEvent] = []
    box: List[RawServer] = []
    with RawServer(echoing_engine(box, status="404 Not Found")) as server:
        box.append(server)
        policy = RetryPolicy(max_attempts=2, on_retry=events.append)
        with SamplerClient(server.url, api_key=KEY, retry=policy) as client:
            with pytest.raises(EngineStatusError):
                client.sample(PROMPT, adapter="a")
    assert len(events) == 1
    cause: Any = events[0].cause
    request = cause.response.request
    assert "Authorization" not in request.headers and request.body is None
    seen = repr(vars(cause)) + repr(vars(cause.response)) + repr(vars(request)) + cause.response.text
    assert secrets_in(seen) == [] and PROMPT not in seen
