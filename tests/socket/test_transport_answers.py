"""Issue 10's reproductions against real loopback servers: every answer becomes the exact result or a precise error.

Each test starts a small misbehaving server (``rawserver.RawServer``) and stops it before it ends.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import requests
import responses
from rawserver import RawServer, json_response

import lora_sampler
from lora_sampler import Adapter, EngineProtocolError, LoraSamplerError, RetryPolicy, SamplerClient, SamplingParams
from lora_sampler.doctor import run_checks

ONCE = RetryPolicy(max_attempts=1)
REPO = Path(__file__).resolve().parents[2]


def choice(index: int, tokens: Optional[List[int]] = None) -> Dict[str, Any]:
    tokens = tokens if tokens is not None else [5, 6]
    return {
        "index": index,
        "text": "xy",
        "token_ids": tokens,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
        "finish_reason": "length",
    }


def completion(model: str = "m", n: int = 1) -> bytes:
    return json.dumps({"model": model, "choices": [choice(i) for i in range(n)]}).encode()


def answering(body: bytes, status: str = "200 OK", content_type: str = "application/json", **headers: str) -> Any:
    """A handler that sends one fixed answer and closes."""
    extra = "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())

    def handler(conn: socket.socket, index: int) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
        conn.sendall((head + "Connection: close\r\n\r\n").encode() + body)

    return handler


def dripping(body: bytes, stop: threading.Event) -> Any:
    """A handler that sends a 200 head, then ``body`` one byte every 0.1 s until it ends or ``stop`` is set."""

    def handler(conn: socket.socket, index: int) -> None:
        conn.sendall(
            f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        for byte in body:
            if stop.wait(0.1):
                return
            conn.sendall(bytes([byte]))

    return handler


def request_line(raw: bytes) -> bytes:
    return raw.split(b"\r\n", 1)[0]


def header(raw: bytes, name: str) -> Optional[str]:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.decode("latin-1").partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def use_proxy(monkeypatch: Any, url: str) -> None:
    """Route plain-HTTP requests through ``url`` (HTTP_PROXY), as a user's environment would."""
    monkeypatch.setenv("HTTP_PROXY", url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)


# -- the base_url path ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["/llm", "/llm/", "/llm/v1"])
def test_answers_base_url_path_kept_on_the_direct_path(suffix: str) -> None:
    """http://gw/llm sends POST /llm/v1/completions and GET /llm/v1/models directly."""
    with RawServer(answering(completion())) as server, SamplerClient(server.url + suffix, retry=ONCE) as client:
        client.sample([1], base_model="m")
    assert request_line(server.requests[0]) == b"POST /llm/v1/completions HTTP/1.1"


def test_answers_base_url_path_kept_through_a_proxy(monkeypatch: Any) -> None:
    """Through HTTP_PROXY the absolute URL keeps the prefix too."""
    with RawServer(answering(completion())) as proxy:
        use_proxy(monkeypatch, proxy.url)
        with SamplerClient("http://gw.invalid/llm/v1", retry=ONCE) as client:
            client.sample([1], base_model="m")
    assert request_line(proxy.requests[0]) == b"POST http://gw.invalid/llm/v1/completions HTTP/1.1"


# -- the read timeout bounds the whole answer ----------------------------------------------------------------


def test_answers_dripping_server_cannot_stretch_an_attempt_past_the_read_timeout() -> None:
    """A valid body sent one byte every 0.1 s (about 20 s in all) fails with a Timeout near the 1 s read timeout."""
    body = completion()
    stop = threading.Event()

    with RawServer(dripping(body, stop)) as server, SamplerClient(server.url, timeout=(1.0, 1.0), retry=ONCE) as client:
        started = time.monotonic()
        try:
            with pytest.raises(requests.Timeout) as info:
                client.sample([1], base_model="m")
        finally:
            stop.set()
        elapsed = time.monotonic() - started
    assert isinstance(info.value, lora_sampler.EngineTimeoutError)
    assert "in full within the read timeout" in str(info.value)
    assert elapsed < 10  # generous: the old transport took len(body) * 0.1 s (~20 s)


# -- redirects, size, close ----------------------------------------------------------------------------------


def test_answers_redirect_is_refused_naming_its_target() -> None:
    """A 302 is not followed: the error is an HTTPError naming the Location, and only one request was sent."""
    target = "http://other.invalid/v1/completions"
    with RawServer(answering(b"", status="302 Found", Location=target)) as server:
        with SamplerClient(server.url, retry=ONCE) as client, pytest.raises(requests.HTTPError) as info:
            client.sample([1], base_model="m")
    assert isinstance(info.value, lora_sampler.EngineStatusError) and info.value.status == 302
    assert target in str(info.value) and "not JSON" not in str(info.value)
    assert len(server.requests) == 1


@responses.activate
def test_answers_redirect_is_refused_on_the_session_path_too() -> None:
    """Through a patched transport (responses) the redirect is not followed either."""
    target = "http://other.invalid/x"
    responses.add(responses.POST, "http://e.invalid/v1/completions", status=307, headers={"Location": target})
    with SamplerClient("http://e.invalid", retry=ONCE) as client, pytest.raises(lora_sampler.EngineStatusError) as info:
        client.sample([1], base_model="m")
    assert info.value.status == 307 and target in str(info.value) and len(responses.calls) == 1


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "close-delimited"])
def test_answers_over_max_response_bytes_are_refused(declared: bool) -> None:
    """An answer larger than max_response_bytes is an EngineProtocolError, with or without a Content-Length."""
    body = completion() + b" " * 5000

    def handler(conn: socket.socket, index: int) -> None:
        length = f"Content-Length: {len(body)}\r\n" if declared else ""
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}Connection: close\r\n\r\n".encode())
        conn.sendall(body)

    with RawServer(handler) as server, SamplerClient(server.url, retry=ONCE, max_response_bytes=1000) as client:
        with pytest.raises(EngineProtocolError, match="max_response_bytes=1000"):
            client.sample([1], base_model="m")
        with SamplerClient(server.url, retry=ONCE) as roomy:
            assert roomy.sample([1], base_model="m").sequences[0].tokens == (5, 6)


def test_answers_max_response_bytes_is_validated() -> None:
    with pytest.raises(ValueError, match="max_response_bytes"):
        SamplerClient("http://h", max_response_bytes=0)


@pytest.mark.parametrize("through_proxy", [False, True], ids=["direct", "proxy"])
def test_answers_close_closes_pooled_sockets_at_once(through_proxy: bool, monkeypatch: Any) -> None:
    """After close(), the server (or proxy) sees the kept-alive connection closed, without waiting for the GC."""
    closed = threading.Event()
    body = completion()

    def keep_alive(conn: socket.socket, index: int) -> None:
        conn.sendall(
            f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        if conn.recv(1) == b"":
            closed.set()

    with RawServer(keep_alive) as server:
        if through_proxy:
            use_proxy(monkeypatch, server.url)
        client = SamplerClient("http://gw.invalid" if through_proxy else server.url, retry=ONCE)
        client.sample([1], base_model="m")
        client.close()
        assert closed.wait(4)


# -- exact answers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "problem"),
    [
        (b"<html><body>Welcome to nginx</body></html>", "text/html", "not JSON"),
        (json.dumps({"model": "m", "choices": []}).encode(), "application/json", "0 choices where num_samples=4"),
        (completion(model="tiny-base", n=4), "application/json", "'tiny-base', not the requested 'm'"),
        (json.dumps({"model": "m", "choices": [1, "x"]}).encode(), "application/json", "no 'choices' list of obj"),
        (json.dumps({"model": "m", "choices": [choice(0, None)] * 4}).encode(), "application/json", "indices"),
        (json.dumps([1, 2]).encode(), "application/json", "not a completion object"),
        (b'{"model": "m", "choi', "application/json", "not JSON"),
    ],
    ids=["html", "no choices", "other model", "choices not objects", "duplicate indices", "list", "truncated json"],
)
def test_answers_a_200_that_is_not_the_exact_answer_is_an_engine_protocol_error(
    body: bytes, content_type: str, problem: str
) -> None:
    """Fewer choices, another model, HTML, junk: EngineProtocolError with status, content type and the body's start."""
    with RawServer(answering(body, content_type=content_type)) as server, SamplerClient(server.url) as client:
        with pytest.raises(EngineProtocolError) as info:
            client.sample([1], base_model="m", num_samples=4)
    error = info.value
    assert isinstance(error, LoraSamplerError) and problem in str(error)
    assert error.status == 200 and error.content_type == content_type
    assert error.body_excerpt == body.decode()[:200] and error.attempts == 1
    assert len(server.requests) == 1  # never retried: the same question gets the same wrong answer


def test_answers_missing_token_ids_or_logprobs_are_refused() -> None:
    """A choice without token ids, or without one logprob per token, is not a sample."""
    no_ids = {"model": "m", "choices": [{**choice(0), "token_ids": None}]}
    short_lps = {"model": "m", "choices": [{**choice(0), "logprobs": {"token_logprobs": [-1.0]}}]}
    for body, problem in ((no_ids, "token_ids"), (short_lps, "token_logprobs")):
        with RawServer(answering(json.dumps(body).encode())) as server, SamplerClient(server.url) as client:
            with pytest.raises(EngineProtocolError, match=problem):
                client.sample([1], base_model="m")


def test_answers_prompt_logprobs_missing_when_asked_are_refused() -> None:
    with RawServer(answering(completion())) as server, SamplerClient(server.url) as client:
        with pytest.raises(EngineProtocolError, match="prompt_logprobs"):
            client.sample([1], base_model="m", prompt_logprobs=True)


def test_answers_models_listing_that_is_html_is_a_lora_sampler_error(tmp_path: Any, capsys: Any) -> None:
    """GET /v1/models answered by an HTML page: a LoraSamplerError; doctor and sample say so, not a JSON error."""
    from lora_sampler.cli import main

    page = b"<!doctype html><title>Login</title>"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": [1]}\n')
    with RawServer(answering(page, content_type="text/html")) as server:
        with SamplerClient(server.url) as client, pytest.raises(EngineProtocolError, match="text/html"):
            client.engine_model()
        findings = run_checks(server.url)
        argv = ["sample", "--base-url", server.url, "--base-model", "m", "--input", str(inp), "--quiet"]
        code = main([*argv, "--output", str(tmp_path / "out.jsonl")])
    assert not findings[0].ok and "not JSON" in findings[0].detail and "Expecting value" not in findings[0].detail
    err = capsys.readouterr().err
    assert code == 2 and "not JSON" in err and "<!doctype html>" in err and "Expecting value" not in err


def test_answers_models_listing_without_data_is_a_lora_sampler_error() -> None:
    with RawServer(answering(b'{"object": "list"}')) as server:
        with SamplerClient(server.url) as client, pytest.raises(EngineProtocolError, match="data"):
            client.engine_model()


def test_answers_unload_of_an_unknown_name_on_an_engine_without_the_route_leaves_files(tmp_path: Any) -> None:
    """Unload answered 404 {"detail": "Not Found"} raises and keeps the files; 404 'cannot be found' is success."""
    folder = tmp_path / "step-1"
    folder.mkdir()
    not_found = answering(b'{"detail":"Not Found"}', status="404 Not Found")
    with RawServer(not_found) as server, SamplerClient(server.url, lora_base_dir=tmp_path) as client:
        with pytest.raises(lora_sampler.EngineStatusError, match="left in place"):
            client.unload("step-1", delete_files=True)
    assert folder.is_dir()
    gone = answering(b'{"error":{"message":"The lora adapter \'step-1\' cannot be found."}}', status="404 Not Found")
    with RawServer(gone) as server, SamplerClient(server.url, lora_base_dir=tmp_path) as client:
        client.unload("step-1", delete_files=True)
    assert not folder.exists()


# -- request ids, userinfo, parameters, names ----------------------------------------------------------------


def test_answers_request_id_fresh_per_attempt_on_errors_and_in_retry_lines(caplog: Any, no_waits: None) -> None:
    """Each attempt sends its own X-Request-Id; the error carries the last one; retry log lines name each."""
    busy = answering(b'{"error":{"message":"The model `a` does not exist."}}', status="404 Not Found")
    caplog.set_level(logging.INFO, logger="lora_sampler")
    policy = RetryPolicy(max_attempts=3)
    with RawServer(busy) as server, SamplerClient(server.url, retry=policy) as client:
        with pytest.raises(lora_sampler.ModelNotFoundError) as info:
            client.sample([1], adapter="a")
    ids = [header(raw, "X-Request-Id") for raw in server.requests]
    assert len(ids) == 3 and len(set(ids)) == 3 and all(ids)
    assert info.value.request_id == ids[-1]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Retrying")]
    assert [ids[0] in lines[0], ids[1] in lines[1]] == [True, True]


def test_answers_transport_errors_carry_the_request_id() -> None:
    def drop(conn: socket.socket, index: int) -> None:
        return

    with RawServer(drop) as server, SamplerClient(server.url, retry=ONCE) as client:
        with pytest.raises(lora_sampler.EngineConnectionError) as info:
            client.sample([1], base_model="m")
    assert info.value.request_id == header(server.requests[0], "X-Request-Id")


def test_answers_userinfo_is_used_for_auth_but_never_printed(caplog: Any, no_waits: None) -> None:
    """http://user:secret@host sends basic auth (as requests would) but the secret is in no repr, error or log."""
    caplog.set_level(logging.DEBUG, logger="lora_sampler")
    answer = answering(b'{"error":{"message":"no: secret-pw"}}', status="404 Not Found")
    with RawServer(answer) as server:
        url = server.url.replace("http://", "http://alice:secret-pw@") + "/llm"
        with SamplerClient(url, retry=RetryPolicy(max_attempts=2)) as client:
            assert "secret-pw" not in repr(client) and "alice" not in client.base_url
            with pytest.raises(lora_sampler.ModelNotFoundError) as info:
                client.sample([1], adapter="a")
    auth = header(server.requests[0], "Authorization")
    assert auth == requests.auth._basic_auth_str("alice", "secret-pw")
    error = info.value
    assert "secret-pw" not in str(error) and "secret-pw" not in repr(error) and "secret-pw" not in error.engine_message
    assert all("secret-pw" not in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError) as bad:
        SamplerClient("ftp://alice:secret-pw@host")
    assert "secret-pw" not in str(bad.value)


def test_answers_engine_echoing_the_api_key_is_redacted(no_waits: None) -> None:
    """An engine that echoes the key in its error body or in a malformed 200 never gets it into an error."""
    key = "sk-echoed-9f8e7d"
    echo = answering(json.dumps({"error": {"message": f"bad key {key}"}}).encode(), status="400 Bad Request")
    with RawServer(echo) as server, SamplerClient(server.url, api_key=key) as client:
        with pytest.raises(lora_sampler.EngineStatusError) as status_info:
            client.sample([1], base_model="m")
    page = f"<html>Authorization: Bearer {key}</html>".encode()
    with RawServer(answering(page, content_type="text/html")) as server, SamplerClient(server.url, api_key=key) as c:
        with pytest.raises(EngineProtocolError) as protocol_info:
            c.sample([1], base_model="m")
    for error in (status_info.value, protocol_info.value):
        assert key not in str(error) and key not in repr(error) and "***" in str(error)
    assert key not in status_info.value.engine_message and key not in protocol_info.value.body_excerpt


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_answers_nan_and_infinity_are_refused_in_sampling_params(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("adapter", ["..", ".", Adapter(".."), Adapter("a\u202eb"), Adapter("x/y")])
def test_answers_dot_dot_adapter_sends_nothing_and_reads_nothing(adapter: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """adapter='..' (or an Adapter named so) is refused before any request and before any file is read."""
    loras = tmp_path / "loras"
    loras.mkdir()
    (tmp_path / "adapter_config.json").write_text("{}")
    read: List[str] = []
    from lora_sampler._adapters import publish

    monkeypatch.setattr(publish, "check_adapter_config", lambda path, model: read.append(path))
    with RawServer(answering(completion(".."))) as server, SamplerClient(server.url, lora_base_dir=loras) as client:
        with pytest.raises(ValueError, match="not a valid adapter name"):
            client.sample([1], adapter=adapter)
    assert server.requests == [] and read == []


def test_answers_cli_records_an_inexact_answer_as_an_error_row_and_resume_runs_it_again(tmp_path: Any) -> None:
    """`lora-sampler sample` (a subprocess) writes a 200 with no choices as an error row, exit 1; resume re-asks."""
    fixed = threading.Event()
    models = json.dumps({"object": "list", "data": [{"id": "m", "root": "m", "parent": None}]}).encode()

    def engine(conn: socket.socket, index: int) -> None:
        path = request_line(server.requests[-1]).split(b" ")[1]
        if path.endswith(b"/v1/models"):
            conn.sendall(json_response(models))
        else:
            conn.sendall(json_response(completion() if fixed.is_set() else b'{"model": "m", "choices": []}'))

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{n}", "prompt": [1, n]}) + "\n" for n in range(3)))
    argv = [sys.executable, "-m", "lora_sampler", "sample", "--base-url", "URL", "--base-model", "m", "--quiet"]
    argv += ["--input", str(inp), "--output", str(out), "--concurrency", "1", "--prompts-per-request", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with RawServer(engine) as server:
        argv[5] = server.url
        first = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, timeout=120)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        fixed.set()
        second = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, timeout=120)
    assert first.returncode == 1, first.stderr
    assert len(rows) == 3 and all("error" in row and "0 choices" in row["error"]["message"] for row in rows)
    assert second.returncode == 0, second.stderr
    final = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in final) == ["p0", "p1", "p2"] and all("error" not in row for row in final)
    assert all(row["sequences"][0]["tokens"] == [5, 6] for row in final)


def test_answers_cli_and_doctor_refuse_a_dot_dot_adapter_before_reading_its_config(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    """`sample --adapter ..` exits 2 naming the rule, and doctor reports it, without reading lora_base_dir/../."""
    from lora_sampler import doctor
    from lora_sampler._adapters import publish
    from lora_sampler.cli import _main as cli

    loras = tmp_path / "loras"
    loras.mkdir()
    (tmp_path / "adapter_config.json").write_text("{}")
    read: List[str] = []
    monkeypatch.setattr(publish, "check_adapter_config", lambda path, model: read.append(path))
    monkeypatch.setattr(doctor, "check_adapter_config", lambda path, model: read.append(path))
    models = json.dumps({"object": "list", "data": [{"id": "m", "root": "m", "parent": None}]}).encode()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": [1]}\n')
    with RawServer(answering(models)) as server:
        argv = ["sample", "--base-url", server.url, "--lora-base-dir", str(loras), "--adapter", "..", "--quiet"]
        code = cli.main([*argv, "--input", str(inp), "--output", str(tmp_path / "out.jsonl")])
        finding = doctor.check_adapter("..", str(loras), "m")
    assert code == 2 and "not a valid adapter name" in capsys.readouterr().err
    assert not finding.ok and "not a valid adapter name" in finding.detail
    assert read == [] and {request_line(r).split(b" ")[1] for r in server.requests} <= {b"/health", b"/v1/models"}


def test_answers_gzip_answer_through_a_proxy_is_decoded(monkeypatch: Any) -> None:
    """The client asks for gzip (as requests does) and the chunked reader decodes it."""
    packed = gzip.compress(completion())

    def gzipped(conn: socket.socket, index: int) -> None:
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        conn.sendall(f"{head}Content-Length: {len(packed)}\r\nConnection: close\r\n\r\n".encode() + packed)

    with RawServer(gzipped) as proxy:
        use_proxy(monkeypatch, proxy.url)
        with SamplerClient("http://gw.invalid", retry=ONCE) as client:
            assert client.sample([1], base_model="m").sequences[0].tokens == (5, 6)
    assert b"gzip" in (header(proxy.requests[0], "Accept-Encoding") or "").encode()


def test_answers_exact_answers_from_the_fake_engine_pass(engine: Any) -> None:
    """The vLLM-shaped answers of FakeEngine pass every exactness check: n choices, prompt and top-k logprobs."""
    with SamplerClient(engine.url) as client:
        output = client.sample(
            [5, 6, 7], base_model=engine.model, num_samples=3, prompt_logprobs=True, topk_prompt_logprobs=2
        )
    assert len(output.sequences) == 3 and all(len(s.tokens) == len(s.logprobs) > 0 for s in output.sequences)
    assert output.model == engine.model and output.prompt_logprobs is not None and len(output.prompt_logprobs) == 3
    assert output.topk_prompt_logprobs is not None and all(len(k) <= 2 for k in output.topk_prompt_logprobs[1:] if k)


def test_answers_health_through_the_transport(engine: Any) -> None:
    """get_text reads /health (200, empty body) and raises the package's errors for a non-2xx answer."""
    from lora_sampler._wire.routes import HEALTH_PATH

    with SamplerClient(engine.url) as client:
        assert client._transport.get_text(HEALTH_PATH) == ""
    sick = answering(b'{"error": {"message": "EngineCore encountered an issue"}}', status="503 Service Unavailable")
    with RawServer(sick) as server, SamplerClient(server.url) as client:
        with pytest.raises(lora_sampler.EngineStatusError) as info:
            client._transport.get_text(HEALTH_PATH)
    assert info.value.status == 503 and info.value.request_id == header(server.requests[0], "X-Request-Id")
