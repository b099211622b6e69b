"""Messages a newcomer reads: a dead engine without the libraries' internal class names, a wrong API key told apart
from a missing one, and the key read from vLLM's own variable (never the OpenAI SDK's).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from lora_sampler import AuthenticationError, EngineConnectionError, RetryPolicy, SamplerClient
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine

ONE_TRY = RetryPolicy(max_attempts=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_connection_refused_names_the_reason_not_internal_classes(capsys: Any) -> None:
    """A refused connection says "could not be reached ([Errno 111] Connection refused)", in Python and the CLI."""
    url = f"http://127.0.0.1:{_free_port()}"
    with SamplerClient(url, retry=ONE_TRY) as client:
        with pytest.raises(EngineConnectionError) as caught:
            client.sample([1, 2], base_model="m")
    message = str(caught.value)
    assert f"the engine at {url} could not be reached (" in message and "Connection refused" in message, message
    for internal in ("HTTPConnection", "ConnectionPool", "object at 0x", "Max retries exceeded", "NewConnectionError"):
        assert internal not in message, message
    assert main(["doctor", "--base-url", url]) == 1
    out = capsys.readouterr().out
    assert "Connection refused" in out and "HTTPConnection" not in out and "object at 0x" not in out, out


def test_wrong_api_key_and_missing_key_get_different_fixes(make_engine: Any) -> None:
    """401 with a key sent says the key was refused; 401 without one says none was sent and how to give one."""
    engine: FakeEngine = make_engine(api_key="right-key")
    with SamplerClient(engine.url, api_key="wrong-key", retry=ONE_TRY) as client:
        with pytest.raises(AuthenticationError) as wrong:
            client.sample([1], base_model=engine.model)
    with SamplerClient(engine.url, retry=ONE_TRY) as client:
        with pytest.raises(AuthenticationError) as missing:
            client.sample([1], base_model=engine.model)
    assert "The API key sent was refused" in str(wrong.value) and "wrong-key" not in str(wrong.value)
    assert "No API key was sent" in str(missing.value) and "VLLM_API_KEY" in str(missing.value)


def test_api_key_from_vllm_variable_after_ours_never_openai(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """$VLLM_API_KEY is read when $LORA_SAMPLER_API_KEY is unset; $OPENAI_API_KEY never travels to the engine."""
    engine: FakeEngine = make_engine(api_key="vllm-key")
    monkeypatch.delenv("LORA_SAMPLER_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "vllm-key")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with SamplerClient(engine.url, retry=ONE_TRY) as client:
        assert not client.has_api_key
        with pytest.raises(AuthenticationError):
            client.sample([1], base_model=engine.model)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    with SamplerClient(engine.url, retry=ONE_TRY) as client:
        assert client.sample([1], base_model=engine.model).sequences
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", "ours-first")
    with SamplerClient(engine.url, retry=ONE_TRY) as client:
        with pytest.raises(AuthenticationError, match="The API key sent was refused"):
            client.sample([1], base_model=engine.model)
