"""``SamplerClient(session=requests.Session)``: the user's session carries every request, with its settings winning.

Real loopback servers (``rawserver.RawServer``, the FakeEngine) see what the session sends; ``responses`` shows that
a test library patching requests sees the same requests.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any, List

import pytest
import requests
import responses
import urllib3
from rawserver import RawServer
from test_transport_answers import answering, completion, dripping, header, request_line

import lora_sampler
from lora_sampler import RetryPolicy, SamplerClient
from lora_sampler.testing import FakeEngine

ONCE = RetryPolicy(max_attempts=1)


class CountingAdapter(requests.adapters.HTTPAdapter):
    """A mounted adapter of the user's (as a signing, retrying or unix-socket adapter would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: List[str] = []

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        self.sent.append(str(request.url))
        return super().send(request, *args, **kwargs)


def test_session_requests_go_through_its_mounted_adapter(engine: FakeEngine) -> None:
    """Every request (sample, fan-out, model listing) goes through the adapter the user mounted."""
    adapter = CountingAdapter()
    with requests.Session() as session:
        session.mount("http://", adapter)
        with SamplerClient(engine.url, session=session, max_workers=4) as client:
            assert client.sample("x", base_model=engine.model).sequences
            requests_ = [{"prompt": f"p{i}", "base_model": engine.model} for i in range(12)]
            assert len(client.sample_many(requests_, prompts_per_request=1)) == 12  # one request per prompt
            client.engine_model()
    assert sum(url.endswith("/v1/completions") for url in adapter.sent) == 13
    assert any(url.endswith("/v1/models") for url in adapter.sent)


def test_session_headers_and_auth_are_sent_and_api_key_sets_authorization() -> None:
    """The session's headers are sent; api_key sets Authorization; without it the session's auth applies."""
    with RawServer(answering(completion())) as server, requests.Session() as session:
        session.headers["X-Corp-Trace"] = "t-1"
        session.headers["User-Agent"] = "corp-agent/2"
        with SamplerClient(server.url, session=session, api_key="sk-user", retry=ONCE) as client:
            client.sample([1], base_model="m")
        session.auth = ("alice", "s3cret")
        with SamplerClient(server.url, session=session, retry=ONCE) as client:
            client.sample([1], base_model="m")
    first, second = server.requests
    assert header(first, "X-Corp-Trace") == "t-1" and header(first, "User-Agent") == "corp-agent/2"
    assert header(first, "Authorization") == "Bearer sk-user"
    assert header(second, "Authorization") == "Basic " + base64.b64encode(b"alice:s3cret").decode()


def test_session_proxies_win() -> None:
    """The session's proxies route the requests (the request line carries the absolute URL)."""
    with RawServer(answering(completion())) as proxy, requests.Session() as session:
        session.proxies = {"http": proxy.url}
        session.trust_env = False
        with SamplerClient("http://engine.invalid:8000", session=session, retry=ONCE) as client:
            assert client.sample([1], base_model="m").sequences
    assert request_line(proxy.requests[0]) == b"POST http://engine.invalid:8000/v1/completions HTTP/1.1"


@responses.activate
def test_session_test_libraries_intercept_a_users_session_too() -> None:
    """responses (which patches requests' adapter) answers the requests of a client on a user's session."""
    responses.add(responses.POST, "http://e.invalid/v1/completions", body=completion())
    with requests.Session() as session, SamplerClient("http://e.invalid", session=session) as client:
        assert client.sample([1], base_model="m").sequences[0].tokens == (5, 6)
    assert len(responses.calls) == 1


def test_session_verify_with_a_session_is_refused() -> None:
    """verify= next to session= would be ignored: it is refused, naming session.verify."""
    with requests.Session() as session:
        with pytest.raises(ValueError, match=r"session\.verify"):
            SamplerClient("https://e.invalid", session=session, verify=False)
        with pytest.raises(TypeError, match=r"requests\.Session"):
            SamplerClient("https://e.invalid", session="not a session")  # type: ignore[arg-type]


def test_session_close_leaves_the_users_session_open(engine: FakeEngine) -> None:
    """Closing the client does not close the session it was given: the user owns it."""
    with requests.Session() as session:
        with SamplerClient(engine.url, session=session) as client:
            client.sample("x", base_model=engine.model)
        assert session.get(f"{engine.url}/health", timeout=5).status_code == 200


@pytest.mark.skipif(
    int(urllib3.__version__.split(".")[0]) < 2,
    reason="urllib3 1.26 (botocore's pin on Python 3.9) reads a body only in whole chunks: no check between reads",
)
def test_session_dripping_body_is_still_bounded_with_a_users_adapter() -> None:
    """With requests' plain adapter (no connection the client can cut), a dripped body still ends near the timeout.

    The check between reads holds; each read waits at most the read timeout, so the attempt ends within about
    twice the read timeout (the client's own session ends it at the read timeout).
    """
    body = completion()
    stop = threading.Event()

    with RawServer(dripping(body, stop)) as server, requests.Session() as session:
        with SamplerClient(server.url, session=session, timeout=(1.0, 1.0), retry=ONCE) as client:
            started = time.monotonic()
            try:
                with pytest.raises(lora_sampler.EngineTimeoutError, match="within the read timeout"):
                    client.sample([1], base_model="m")
            finally:
                stop.set()
            assert time.monotonic() - started < 10  # the body alone takes len(body) * 0.1 s (~20 s)


BOOM = b'{"object": "error", "message": "boom", "type": "InternalServerError", "code": 500}'
BOOM_500 = answering(BOOM, status="500 Internal Server Error")


@pytest.mark.parametrize(
    ("retry", "named"),
    [
        # The transport guide's "retrying adapter" as users write it: a 500 "boom" became EngineTimeoutError after
        # 92.6 s and 49 requests, the engine's words lost (urllib3 drops the body when it gives up).
        (urllib3.Retry(total=5, backoff_factor=0.1, status_forcelist=[500, 502], allowed_methods=None), "500, 502"),
        # Read retries of the client's POSTs: a hanging engine took 164.9 s where the read timeout says 15.3 s.
        (urllib3.Retry(total=3, read=3, allowed_methods=None), "read errors"),
        # HTTPAdapter(max_retries=3): GETs (/v1/models, /health) re-read, and a 503 with Retry-After retried.
        (urllib3.Retry(3), "503"),
    ],
)
def test_session_whose_adapter_retries_answers_is_refused_naming_why(retry: urllib3.Retry, named: str) -> None:
    """A session whose adapter retries answers or reads under the retry table is refused before any request."""
    with RawServer(BOOM_500) as server, requests.Session() as session:
        session.mount("http://", requests.adapters.HTTPAdapter(max_retries=retry))
        with pytest.raises(ValueError, match="retries") as refused:
            SamplerClient(server.url, session=session)
    message = str(refused.value)
    assert named in message and "RetryPolicy" in message and "Retry(connect=" in message
    assert server.requests == []


@pytest.mark.parametrize("max_retries", [0, urllib3.Retry(connect=3, read=False, respect_retry_after_header=False)])
def test_session_without_answer_retries_reports_the_engines_status_and_words(max_retries: Any) -> None:
    """requests' plain adapter, or one retrying connections only (nothing was sent): the 500 "boom" is raised as the
    engine said it, after one request (the retry table raises a 500 at once)."""
    with RawServer(BOOM_500) as server, requests.Session() as session:
        session.mount("http://", requests.adapters.HTTPAdapter(max_retries=max_retries))
        with SamplerClient(server.url, session=session) as client:
            with pytest.raises(lora_sampler.InternalServerError, match="boom") as raised:
                client.sample([1], base_model="m")
    assert raised.value.status == 500
    assert len(server.requests) == 1
