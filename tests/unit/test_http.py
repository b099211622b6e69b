"""The transport: URLs, headers, the API key's sources, and the connection pool's size."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import requests
import responses

from lora_sampler import BadRequestError, SamplerClient
from lora_sampler._transport.connections import RecordingHTTPConnectionPool
from lora_sampler._transport.exchange import normalise_base_url
from lora_sampler._transport.session import POOL_HEADROOM

OK = {
    "model": "b",
    "choices": [
        {"index": 0, "text": "", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "length"}
    ],
}


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_http_base_url_with_or_without_v1(url: str) -> None:
    """A trailing /v1 is accepted and never doubled."""
    assert normalise_base_url(url) == "http://h:8000"


def test_http_base_url_must_be_http() -> None:
    """A URL without a scheme is a ValueError naming base_url and an example."""
    with pytest.raises(ValueError, match="base_url"):
        SamplerClient("localhost:8000")


@responses.activate
def test_http_api_key_from_environment_is_sent_as_bearer(monkeypatch: Any) -> None:
    """LORA_SAMPLER_API_KEY is used when api_key is not given; User-Agent and JSON are set."""
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", "env-key")
    responses.add(responses.POST, "http://h/v1/completions", json=OK)
    with SamplerClient("http://h/v1") as client:
        client.sample([1], base_model="b")
    headers = responses.calls[0].request.headers
    assert headers["Authorization"] == "Bearer env-key"
    assert headers["Content-Type"] == "application/json" and headers["User-Agent"].startswith("lora-sampler/")


@responses.activate
def test_http_explicit_key_wins_and_no_key_sends_no_header(monkeypatch: Any) -> None:
    """api_key= overrides the environment; with neither, no Authorization header is sent."""
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", "env-key")
    responses.add(responses.POST, "http://h/v1/completions", json=OK)
    with SamplerClient("http://h", api_key="arg-key") as client:
        client.sample([1], base_model="b")
    monkeypatch.delenv("LORA_SAMPLER_API_KEY")
    with SamplerClient("http://h") as client:
        client.sample([1], base_model="b")
    assert responses.calls[0].request.headers["Authorization"] == "Bearer arg-key"
    assert "Authorization" not in responses.calls[1].request.headers


@responses.activate
def test_http_netrc_login_is_sent_as_basic_auth_and_its_password_redacted(monkeypatch: Any, tmp_path: Any) -> None:
    """With no API key and no user:password@, $NETRC's login for the host is sent, as requests sends it; an engine
    echoing the password in an error shows it as ***."""
    for variable in ("LORA_SAMPLER_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine h login alice password pw-netrc-secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    echo = {"error": {"message": "bad request from alice:pw-netrc-secret"}}
    responses.add(responses.POST, "http://h/v1/completions", status=400, json=echo)
    with SamplerClient("http://h") as client, pytest.raises(BadRequestError) as info:
        client.sample([1], base_model="b")
    sent = responses.calls[0].request.headers["Authorization"]
    assert sent == "Basic " + base64.b64encode(b"alice:pw-netrc-secret").decode()
    assert "pw-netrc-secret" not in str(info.value) and "***" in str(info.value)


def test_http_pool_is_sized_to_max_workers() -> None:
    """The session's adapter keeps max_workers (+ headroom for loads) connections per host."""
    with SamplerClient("http://h", max_workers=48) as client:
        adapter = client._transport.session.get_adapter("http://h")
        assert adapter.pool_maxsize == 48 + POOL_HEADROOM  # type: ignore[attr-defined]
        assert adapter.max_retries.total == 0  # type: ignore[attr-defined]


def test_http_the_engine_has_one_recording_pool_and_other_urls_get_requests_own() -> None:
    """Requests to the engine share the one pool whose connections a deadline can cut; another host gets requests'."""
    with SamplerClient("http://h:8000/llm", max_workers=2) as client:
        session = client._transport.session
        adapter = session.get_adapter("http://h:8000")
        engine = requests.Request("GET", "http://h:8000/llm/v1/models").prepare()
        other = requests.Request("GET", "http://other:8000/v1/models").prepare()
        pool = adapter.get_connection_with_tls_context(engine, session.verify)  # type: ignore[attr-defined]
        assert isinstance(pool, RecordingHTTPConnectionPool) and (pool.host, pool.port) == ("h", 8000)
        assert adapter.get_connection_with_tls_context(engine, session.verify) is pool  # type: ignore[attr-defined]
        elsewhere = adapter.get_connection_with_tls_context(other, session.verify)  # type: ignore[attr-defined]
        assert not isinstance(elsewhere, RecordingHTTPConnectionPool) and elsewhere.host == "other"


def test_http_closed_client_refuses_work() -> None:
    """A closed client says so instead of failing obscurely."""
    client = SamplerClient("http://h")
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.sample([1], base_model="b")
    client.close()


def test_http_userinfo_is_in_no_repr() -> None:
    """A user:password@ in base_url shows in no repr: client, Ray settings or Ray batches."""
    from lora_sampler.ray_data import ClientSettings, SampleBatches

    url = "http://alice:pw-secret@h:8000/llm/v1"
    with SamplerClient(url) as client:
        shown = [repr(client), client.base_url]
    settings = ClientSettings(url)
    shown += [repr(settings), repr(SampleBatches(settings, base_model="b"))]
    assert all("pw-secret" not in text and "alice" not in text for text in shown)
    assert shown[1] == "http://h:8000/llm" and "h:8000/llm" in shown[2]
