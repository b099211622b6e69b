"""Issue 23's hostile answers against real loopback servers: each is bounded in time or is an EngineProtocolError.

Each test starts a small misbehaving server (``rawserver.RawServer``) and stops it before it ends.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from rawserver import RawServer
from test_transport_answers import answering

from lora_sampler import EngineProtocolError, EngineTimeoutError, LoraSamplerError, RetryPolicy, SamplerClient
from lora_sampler._transport.http import EngineTransport
from lora_sampler.cli import main

ONCE = RetryPolicy(max_attempts=1)


def dripping_headers(stop: threading.Event, finished: threading.Event) -> Callable[[socket.socket, int], None]:
    """A handler that sends a status line and 400 bytes of headers one byte every 0.05 s (about 20 s in all)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 400 + b"\r\n"

    def handler(conn: socket.socket, index: int) -> None:
        for byte in head:
            if stop.wait(0.05):
                return
            conn.sendall(bytes([byte]))
        finished.set()
        conn.sendall(b"Content-Length: 2\r\n\r\n{}")

    return handler


def completion_with_logprob(logprob: str) -> bytes:
    """A one-choice completion whose only token logprob is written as ``logprob`` (raw JSON text)."""
    return (
        '{"model": "m", "choices": [{"index": 0, "text": "x", "token_ids": [5], '
        f'"logprobs": {{"token_logprobs": [{logprob}]}}, "finish_reason": "length"}}]}}'
    ).encode()


def test_hostile_dripped_headers_fail_within_the_read_timeout() -> None:
    """Headers dripped one byte per 0.05 s (20 s in all) end the attempt with a timeout while they still drip."""
    stop, finished = threading.Event(), threading.Event()
    with RawServer(dripping_headers(stop, finished)) as server:
        with SamplerClient(server.url, timeout=(1.0, 1.0), retry=ONCE) as client:
            try:
                with pytest.raises(EngineTimeoutError, match="within the read timeout"):
                    client.sample([1], base_model="m")
                assert not finished.is_set()  # the old transport waited for every header byte
            finally:
                stop.set()


def test_hostile_dripped_headers_fail_the_cli_startup_check(tmp_path: Path, capsys: Any) -> None:
    """The CLI's startup check against a header-dripping engine exits 2 while the headers still drip."""
    stop, finished = threading.Event(), threading.Event()
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": [1]}\n')
    with RawServer(dripping_headers(stop, finished)) as server:
        argv = ["sample", "--base-url", server.url, "--base-model", "m", "--input", str(prompts)]
        try:
            started = time.monotonic()
            assert main([*argv, "--output", str(tmp_path / "out.jsonl"), "--timeout", "1,1", "--quiet"]) == 2
            assert not finished.is_set(), f"the check waited {time.monotonic() - started:.1f} s for every byte"
        finally:
            stop.set()
    assert "read timeout" in capsys.readouterr().err


@pytest.mark.parametrize(
    "logprob",
    ["1" + "0" * 400, "-1e400", "NaN", "Infinity", "-Infinity"],
    ids=["10**400", "-1e400", "NaN", "Infinity", "-Infinity"],
)
def test_hostile_logprob_that_is_no_finite_float_is_a_protocol_error(logprob: str) -> None:
    """A logprob of 10**400 (OverflowError before), -1e400, NaN or Infinity is an EngineProtocolError, not a result."""
    with RawServer(answering(completion_with_logprob(logprob))) as server:
        with SamplerClient(server.url, retry=ONCE) as client:
            with pytest.raises(EngineProtocolError, match=r"too large for a float|not strict JSON"):
                client.sample([1], base_model="m")


@pytest.mark.parametrize("shape", ["[", '{"a":'])
def test_hostile_body_nested_100000_deep_is_a_protocol_error(shape: str) -> None:
    """A body nested 100,000 deep (a raw RecursionError before) is an EngineProtocolError naming the nesting."""
    body = (shape * 100_000).encode()
    with RawServer(answering(body)) as server:
        with SamplerClient(server.url, retry=ONCE) as client:
            with pytest.raises(EngineProtocolError, match="nested too deep"):
                client.sample([1], base_model="m")


def test_hostile_error_body_nested_100000_deep_is_still_a_status_error() -> None:
    """A 400 whose body is nested 100,000 deep is classified by its status, not a raw RecursionError."""
    body = b"[" * 100_000

    def handler(conn: socket.socket, index: int) -> None:
        head = f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        conn.sendall((head + "Connection: close\r\n\r\n").encode() + body)

    with RawServer(handler) as server:
        with SamplerClient(server.url, retry=ONCE) as client:
            with pytest.raises(LoraSamplerError) as info:
                client.sample([1], base_model="m")
    assert getattr(info.value, "status", None) == 400


def test_hostile_body_labelled_gzip_that_is_not_gzip_is_a_protocol_error() -> None:
    """A body labelled ``Content-Encoding: gzip`` that is not gzip is an EngineProtocolError naming the encoding."""
    with RawServer(answering(b'{"not": "gzip"}', Content_Encoding="gzip")) as server:
        with SamplerClient(server.url, retry=ONCE) as client:
            with pytest.raises(EngineProtocolError, match="Content-Encoding"):
                client.sample([1], base_model="m")


def test_hostile_parser_bug_is_not_reported_as_an_engine_fault() -> None:
    """An AttributeError inside a parser propagates as itself: a bug of ours is no malformed answer."""

    def buggy(body: Any) -> Any:
        return body.no_such_attribute

    with RawServer(answering(json.dumps({"data": []}).encode())) as server:
        transport = EngineTransport(server.url)
        try:
            with pytest.raises(AttributeError):
                transport.get_json("/v1/models", parse=buggy)
        finally:
            transport.close()


@pytest.mark.parametrize("cards", [[], [{"id": "lora-a", "parent": "base"}]], ids=["no card", "adapters only"])
def test_hostile_models_without_a_base_card_have_no_context_length(cards: Any) -> None:
    """An engine whose ``/v1/models`` lists no base model does not say its context length: ``max_model_len`` is None
    (a ``max_tokens=None`` request is sent without the field), while ``engine_model``, which needs the base card, is
    an EngineProtocolError saying it lists none (since the one cached read of the base cards, max_model_len raised it
    too, so every ``max_tokens=None`` request failed)."""
    with RawServer(answering(json.dumps({"object": "list", "data": cards}).encode())) as server:
        with SamplerClient(server.url, retry=ONCE) as client:
            assert client.max_model_len() is None
            with pytest.raises(EngineProtocolError, match="lists no base model"):
                client.engine_model()
