"""A proxy whose engine is away is named as what answered: base_url is right, the engine behind the proxy is not up.

Before, nginx's "502 Bad Gateway" page read as "check that base_url is the engine's root", and a refusing
HTTP_PROXY read as "the engine at ... could not be reached; check base_url".
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Type

import pytest
from rawserver import RawServer, json_response
from test_transport_env import COMPLETION

from lora_sampler import EngineConnectionError, InternalServerError, RetryPolicy, SampleOutput, SamplerClient

ONE_TRY = RetryPolicy(max_attempts=1)
NGINX_PAGE = (
    b"<html>\r\n<head><title>{status}</title></head>\r\n<body>\r\n<center><h1>{status}</h1></center>\r\n"
    b"<hr><center>nginx/1.24.0</center>\r\n</body>\r\n</html>\r\n"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sample_error(url: str, error_class: Type[Exception]) -> Exception:
    """The error one sample through ``url`` raises (once: no retries), checked to be an ``error_class``."""
    with SamplerClient(url, retry=ONE_TRY) as client:
        with pytest.raises(error_class) as caught:
            client.sample([1, 2], base_model="m")
    return caught.value


def _through_proxy(monkeypatch: Any, url: str, variable: str = "HTTP_PROXY") -> None:
    """Send requests through ``url`` (``variable``, nothing bypassing it), as a user's environment would."""
    monkeypatch.setenv(variable, url)
    for name in ("NO_PROXY", "no_proxy", variable.lower()):
        monkeypatch.delenv(name, raising=False)


def _proxy_page(status: str, server: str = "nginx/1.24.0") -> Callable[[socket.socket, int], None]:
    body = NGINX_PAGE.replace(b"{status}", status.encode())

    def handler(conn: socket.socket, index: int) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        head += f"Server: {server}\r\n" if server else ""
        conn.sendall(head.encode() + b"\r\n" + body)

    return handler


@pytest.mark.parametrize("status", ["502 Bad Gateway", "503 Service Temporarily Unavailable", "504 Gateway Time-out"])
def test_a_proxy_page_for_a_dead_upstream_names_the_proxy_not_base_url(status: str) -> None:
    """A gateway status from a proxy names the proxy and says the engine behind it is unreachable, once."""
    with RawServer(_proxy_page(status)) as proxy:
        message = str(_sample_error(proxy.url, InternalServerError))
        sent = len(proxy.requests)
    assert sent == 1, sent
    assert "nginx/1.24.0" in message and "the engine behind it" in message, message
    assert "check that base_url" not in message and "<html" not in message, message


def test_a_gateway_status_without_a_page_or_server_name_still_names_a_proxy() -> None:
    """A bare 502 (no Server header, no page title) is still a proxy's: vLLM never answers 502."""
    with RawServer(_proxy_page("502 Bad Gateway", server="")) as proxy:
        message = str(_sample_error(proxy.url, InternalServerError))
    assert "a proxy or gateway answered" in message.lower(), message


def test_a_refusing_proxy_from_the_environment_is_named_with_the_way_to_go_direct(monkeypatch: Any) -> None:
    """HTTP_PROXY pointing at nothing: the error names that proxy and NO_PROXY, not "check base_url"."""
    dead_proxy = f"http://127.0.0.1:{_free_port()}"
    _through_proxy(monkeypatch, dead_proxy)
    message = str(_sample_error("http://engine.invalid:8000", EngineConnectionError))
    assert f"the proxy {dead_proxy} for the engine" in message and "NO_PROXY=engine.invalid" in message, message
    assert "check base_url" not in message, message


def test_a_proxy_from_the_environment_answering_502_is_named_by_its_url(monkeypatch: Any) -> None:
    """Through HTTP_PROXY, a 502 names that proxy's URL as what answered."""
    with RawServer(_proxy_page("502 Bad Gateway", server="")) as proxy:
        proxy_url = proxy.url
        _through_proxy(monkeypatch, proxy_url)
        message = str(_sample_error("http://engine.invalid:8000", InternalServerError))
    assert f"The proxy {proxy_url} answered" in message and "NO_PROXY=engine.invalid" in message, message


def test_an_engine_away_behind_a_proxy_is_waited_out_with_max_outage() -> None:
    """A proxy's 502 is an outage (the engine behind it is away): with max_outage the requests are held, the
    proxy probed, and every request answered once the engine is back; nothing is lost."""
    back = threading.Event()
    page = _proxy_page("502 Bad Gateway")

    def proxy_then_engine(conn: socket.socket, index: int) -> None:
        if index >= 4:  # four 502s seen: the engine behind the proxy is back
            back.set()
        if not back.is_set():
            page(conn, index)
            return
        path = proxy.requests[index].split(b" ", 2)[1]
        body = COMPLETION if path.endswith(b"/completions") else b"{}"
        conn.sendall(json_response(body))

    with RawServer(proxy_then_engine) as proxy:
        with SamplerClient(proxy.url, retry=ONE_TRY) as client:
            requests = [{"prompt": [1, 2], "base_model": "m"}] * 3
            results = client.sample_many(requests, max_outage=60, return_exceptions=True, prompts_per_request=1)
    assert back.is_set() and all(isinstance(result, SampleOutput) for result in results), results


def test_an_https_proxy_refusing_the_tunnel_is_named_with_its_answer(monkeypatch: Any) -> None:
    """HTTPS_PROXY answering CONNECT with 502 (it cannot reach the engine): the proxy is named with its answer."""

    def refuse_tunnel(conn: socket.socket, index: int) -> None:
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    with RawServer(refuse_tunnel) as proxy:
        proxy_url = proxy.url
        _through_proxy(monkeypatch, proxy_url, "HTTPS_PROXY")
        message = str(_sample_error("https://engine.invalid:8443", EngineConnectionError))
        tunnels = [request.split(b" ", 1)[0] for request in proxy.requests]
    assert tunnels == [b"CONNECT"], tunnels
    assert f"the proxy {proxy_url} for the engine" in message and "502" in message, message
    assert "NO_PROXY=engine.invalid" in message and "check base_url" not in message, message
