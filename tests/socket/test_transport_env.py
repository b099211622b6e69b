"""The environment requests users rely on keeps working on the fast transport path (proxies, CA bundle)."""

from __future__ import annotations

import json
import socket
from typing import Any

import responses
from rawserver import RawServer, json_response

from lora_sampler import SamplerClient

COMPLETION = json.dumps(
    {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": [3],
                "logprobs": {"token_logprobs": [-0.1]},
                "finish_reason": "length",
            }
        ],
    }
).encode()


def answer(conn: socket.socket, index: int) -> None:
    conn.sendall(json_response(COMPLETION))


def test_transport_http_proxy_from_environment_is_used(monkeypatch: Any) -> None:
    """HTTP_PROXY routes requests through the proxy, with the absolute URL in the request line."""
    with RawServer(answer) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        with SamplerClient("http://engine.invalid:8000", api_key="k") as client:
            assert client.sample([1], base_model="m").sequences[0].tokens == (3,)
    request_line = proxy.requests[0].split(b"\r\n", 1)[0]
    assert request_line == b"POST http://engine.invalid:8000/v1/completions HTTP/1.1"


def test_transport_no_proxy_goes_direct(monkeypatch: Any) -> None:
    """NO_PROXY naming the engine host bypasses HTTP_PROXY, and the direct request line is a path."""
    with RawServer(answer) as engine:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        with SamplerClient(engine.url) as client:
            assert client.sample([1], base_model="m").sequences
    assert engine.requests[0].startswith(b"POST /v1/completions HTTP/1.1")


def test_transport_ca_bundle_from_environment_is_read(monkeypatch: Any, tmp_path: Any) -> None:
    """REQUESTS_CA_BUNDLE sets TLS verification, as with plain requests; verify=False still wins."""
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    with SamplerClient("https://engine.invalid") as client:
        assert client._transport.session.verify == str(bundle)
    with SamplerClient("https://engine.invalid", verify=False) as client:
        assert client._transport.session.verify is False


def test_transport_headers_on_the_wire(monkeypatch: Any) -> None:
    """The client sends the headers requests users expect: auth, JSON type, user agent, session id."""
    with RawServer(answer) as engine, SamplerClient(engine.url, api_key="sk-1") as client:
        client.sample([1], base_model="m", session_id="sess-9")
    head = engine.requests[0].split(b"\r\n\r\n", 1)[0].lower()
    for header in (
        b"authorization: bearer sk-1",
        b"content-type: application/json",
        b"x-session-id: sess-9",
        b"user-agent: lora-sampler/",
    ):
        assert header in head


@responses.activate
def test_transport_mocking_libraries_still_intercept() -> None:
    """With responses active (it patches requests' adapter), requests go through the patched transport."""
    responses.add(responses.POST, "http://127.0.0.1:9/v1/completions", body=COMPLETION)
    with SamplerClient("http://127.0.0.1:9") as client:
        assert client.sample([1], base_model="m").sequences[0].tokens == (3,)
    assert len(responses.calls) == 1


def test_transport_cookies_set_by_a_gateway_are_sent_back() -> None:
    """A cookie the engine's gateway sets (sticky routing) is sent with the next request, as requests would."""

    def sticky(conn: socket.socket, index: int) -> None:
        body = COMPLETION
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nSet-Cookie: route=replica-2; Path=/\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    with RawServer(sticky) as engine, SamplerClient(engine.url) as client:
        client.sample([1], base_model="m")
        client.sample([1], base_model="m")
    first, second = (request.split(b"\r\n\r\n", 1)[0].lower() for request in engine.requests)
    assert b"cookie:" not in first and b"cookie: route=replica-2" in second
