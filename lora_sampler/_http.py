"""The transport: one HTTP request per call to the engine, and errors translated into lora_sampler's.

Owns URL normalisation (``/v1`` never doubled), the ``requests.Session`` and its connection pool, the auth and
routing headers, and the translation of transport exceptions (requests' adapter pattern). No retries (the pool's
own are off, so retries happen in ``retry.py`` only) and no threads.

Speed: ``Session.request`` re-reads the environment (proxies, CA bundle, netrc) and builds cookie jars and hook
tables on every call, which more than doubles the client's CPU per request. The environment is read once per
transport instead, and requests go straight to the session's own pooled ``HTTPAdapter`` connection pool, which is
configured by requests itself (TLS verification, CA bundle, client certificate). The full ``Session`` path is kept
whenever a proxy applies to the engine URL, or when a test library has patched requests' transport (``responses``,
``requests-mock``), so those keep working exactly as with plain requests.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union, cast

import requests
import urllib3
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.exceptions import (
    ConnectTimeoutError,
    NewConnectionError,
    ProtocolError,
    ProxyError,
    ReadTimeoutError,
    SSLError,
)

from lora_sampler import __version__
from lora_sampler.errors import (
    EngineConnectionError,
    EngineConnectTimeoutError,
    EngineError,
    EngineStatusError,
    EngineTimeoutError,
)

logger = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
#: Header vLLM routers hash to pick a replica (ROUTER.md §3a).
SESSION_HEADER = "X-Session-ID"
#: Extra pooled connections beyond ``max_workers``: proactive loads and callers' own threads run beside the pool.
POOL_HEADROOM = 4

Timeout = Union[float, Tuple[float, float]]

# The transport methods as requests ships them: when a test library patches them, take the full Session path.
_PRISTINE_ADAPTER_SEND = HTTPAdapter.send
_PRISTINE_GET_ADAPTER = requests.Session.get_adapter


def normalise_base_url(base_url: str) -> str:
    """Return the engine root URL: no trailing slash and no trailing ``/v1`` (paths add it back once).

    Raises:
        ValueError: ``base_url`` is not an http(s) URL.
    """
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {base_url!r}")
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def redact(text: str, secret: Optional[str]) -> str:
    """Replace every occurrence of ``secret`` in ``text`` (an API key must never reach a message or a log)."""
    return text.replace(secret, "***") if secret else text


class EngineTransport:
    """Sends single requests to one vLLM engine over one pooled ``requests.Session``.

    Args:
        base_url: The engine root, with or without ``/v1``.
        api_key: Sent as ``Authorization: Bearer ...`` when given.
        timeout: ``(connect, read)`` seconds, or one number for both, used on every request.
        max_workers: Threads that may use the session at once; the pool keeps that many connections.
        verify: TLS verification: True, False, or a CA bundle path.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str] = None,
        timeout: Timeout = (10.0, 300.0),
        max_workers: int = 16,
        verify: Union[bool, str] = True,
    ):
        self.base_url = normalise_base_url(base_url)
        self.timeout = timeout
        self._api_key = api_key
        self.session = requests.Session()
        self._adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max_workers + POOL_HEADROOM, max_retries=0)
        self.session.mount("http://", self._adapter)
        self.session.mount("https://", self._adapter)
        # The environment requests users rely on (HTTP(S)_PROXY, NO_PROXY, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE,
        # ~/.netrc) is read here, once, instead of on every request.
        settings = self.session.merge_environment_settings(self.base_url, {}, None, verify, None)
        self.session.trust_env = False
        self.session.verify = settings["verify"]
        self.session.proxies = settings["proxies"]
        self._headers: Dict[str, str] = {"User-Agent": f"lora-sampler/{__version__}", "Accept": "*/*"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        else:
            netrc = requests.utils.get_netrc_auth(self.base_url)
            if netrc:
                self._headers["Authorization"] = requests.auth._basic_auth_str(*netrc)
        self.session.headers.update(self._headers)
        self._urls = {
            path: self.base_url + path
            for path in (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH, MODELS_PATH)
        }
        self._pool = self._direct_pool()

    @property
    def has_api_key(self) -> bool:
        """Whether requests carry ``Authorization: Bearer`` (the key itself is never exposed)."""
        return bool(self._api_key)

    def _direct_pool(self) -> Optional[urllib3.HTTPConnectionPool]:
        """Return the adapter's pool for the engine, configured by requests, or None when a proxy applies."""
        if requests.utils.select_proxy(self.base_url, self.session.proxies):
            return None
        probe = requests.Request("GET", self.base_url + "/").prepare()
        if hasattr(self._adapter, "get_connection_with_tls_context"):  # requests >= 2.32.2
            pool = self._adapter.get_connection_with_tls_context(probe, self.session.verify, None, None)
        else:  # pragma: no cover - older requests
            pool = self._adapter.get_connection(self.base_url, None)
            self._adapter.cert_verify(pool, self.base_url, self.session.verify, None)  # type: ignore[no-untyped-call]
        return cast(urllib3.HTTPConnectionPool, pool)

    def _is_direct(self) -> bool:
        return (
            self._pool is not None
            and HTTPAdapter.send is _PRISTINE_ADAPTER_SEND
            and type(self.session).get_adapter is _PRISTINE_GET_ADAPTER
        )

    def close(self) -> None:
        """Close pooled connections (avoids ResourceWarning on interpreter exit)."""
        self.session.close()

    def complete(self, payload: Mapping[str, Any], *, model: str, adapter: bool, session_id: str) -> Dict[str, Any]:
        """Send one ``POST /v1/completions`` and return the JSON body of a 2xx answer.

        This is the hot path: a successful answer is parsed from the pooled connection's bytes without building a
        ``requests.Response``; one is built only for an error, so the error carries ``.response``.

        Raises:
            EngineError: a transport failure or an error status, classified for the retry table.
        """
        return self._sample(COMPLETIONS_PATH, payload, model, adapter, session_id)

    def chat(self, payload: Mapping[str, Any], *, model: str, adapter: bool, session_id: str) -> Dict[str, Any]:
        """Send one ``POST /v1/chat/completions`` and return the JSON body of a 2xx answer (as ``complete``).

        Raises:
            EngineError: a transport failure or an error status, classified for the retry table.
        """
        return self._sample(CHAT_COMPLETIONS_PATH, payload, model, adapter, session_id)

    def _sample(
        self, path: str, payload: Mapping[str, Any], model: str, adapter: bool, session_id: str
    ) -> Dict[str, Any]:
        exchange = _Exchange.post(path, payload, session_id, self.timeout, model, adapter)
        if self._is_direct():
            answer = self._urlopen(exchange)
            if answer.status < 400:
                return self._completion_body(answer.status, answer.data, exchange)
            response = self._as_response(exchange, answer)
        else:
            response = self._session_request(exchange)
            if response.status_code < 400:
                return self._completion_body(response.status_code, response.content, exchange)
        raise self._status_error(response, model, adapter)

    def _completion_body(self, status: int, content: bytes, exchange: _Exchange) -> Dict[str, Any]:
        try:
            body = json.loads(content)
        except ValueError:
            raise EngineError(
                f"the engine at {self.base_url} answered HTTP {status} to {exchange.path} with a body that is "
                "not JSON; check that base_url points at a vLLM server",
                model=exchange.model,
                adapter=exchange.adapter,
            ) from None
        if not isinstance(body, dict):
            raise EngineError(f"the engine answered a JSON {type(body).__name__}, not an object", model=exchange.model)
        return body

    def post(
        self,
        path: str,
        payload: Mapping[str, Any],
        *,
        model: Optional[str],
        adapter: bool,
        session_id: Optional[str] = None,
        timeout: Optional[Timeout] = None,
        raise_for_status: bool = True,
    ) -> requests.Response:
        """Send one POST with a JSON body and return the response.

        Raises:
            EngineError: a transport failure, or (with ``raise_for_status``) an error status.
        """
        response = self._request(_Exchange.post(path, payload, session_id, timeout or self.timeout, model, adapter))
        if raise_for_status and response.status_code >= 400:
            raise self._status_error(response, model, adapter)
        return response

    def get(self, path: str, *, timeout: Optional[Timeout] = None) -> requests.Response:
        """Send one GET and return the response (``timeout`` overrides the client's, e.g. for a short probe).

        Raises:
            EngineError: a transport failure or an error status.
        """
        response = self._request(_Exchange("GET", path, None, {}, timeout or self.timeout, None, False))
        if response.status_code >= 400:
            raise self._status_error(response, None, False)
        return response

    def _url(self, path: str) -> str:
        return self._urls.get(path) or self.base_url + path

    def _request(self, exchange: _Exchange) -> requests.Response:
        if not self._is_direct():
            return self._session_request(exchange)
        return self._as_response(exchange, self._urlopen(exchange))

    def _session_request(self, exchange: _Exchange) -> requests.Response:
        """Send through ``Session.request``: the path for proxies and for patched (mocked) transports."""
        try:
            return self.session.request(
                exchange.method,
                self._url(exchange.path),
                data=exchange.data,
                headers=exchange.headers,
                timeout=exchange.timeout,
            )
        except requests.RequestException as exc:
            raise self._translate(exc, exchange) from None

    def _urlopen(self, exchange: _Exchange) -> urllib3.BaseHTTPResponse:
        """Send on the adapter's own connection pool and read the whole answer (no retries, no redirects)."""
        timeout = exchange.timeout
        connect, read = timeout if isinstance(timeout, tuple) else (timeout, timeout)
        assert self._pool is not None
        try:
            return self._pool.urlopen(
                exchange.method,
                exchange.path,
                body=exchange.data,
                headers={**self._headers, **exchange.headers},
                timeout=urllib3.Timeout(connect=connect, read=read),
                retries=False,
                redirect=False,
                assert_same_host=False,
                preload_content=True,
            )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._translate(exc, exchange) from None

    def _as_response(self, exchange: _Exchange, answer: urllib3.BaseHTTPResponse) -> requests.Response:
        """Wrap a urllib3 answer (already read) in a ``requests.Response``, as requests' adapter would."""
        url = self._url(exchange.path)
        response = requests.Response()
        response.status_code = answer.status
        response.headers = CaseInsensitiveDict(answer.headers)
        response._content = answer.data
        response.reason = answer.reason or ""
        response.url = url
        response.encoding = requests.utils.get_encoding_from_headers(response.headers)
        request = requests.PreparedRequest()
        request.method, request.url, request.body = exchange.method, url, exchange.data
        request.headers = CaseInsensitiveDict({**self._headers, **exchange.headers})
        response.request = request
        return response

    def _status_error(self, response: requests.Response, model: Optional[str], adapter: bool) -> EngineStatusError:
        error = EngineStatusError.from_response(response, model=model, adapter=adapter)
        error.message = redact(error.message, self._api_key)
        error.engine_message = redact(error.engine_message, self._api_key)
        error.args = (error.message,)
        return error

    def _translate(self, exc: Exception, exchange: _Exchange) -> EngineError:
        """Map a ``requests`` or ``urllib3`` exception to the matching ``EngineError`` (the one place that does it)."""
        model, adapter = exchange.model, exchange.adapter
        what = f" for {'LoRA adapter' if adapter else 'base model'} {model!r}" if model else ""
        detail = redact(f"{type(exc).__name__}: {exc}", self._api_key)
        error_class: type[EngineError]
        # urllib3's NewConnectionError subclasses ConnectTimeoutError for history's sake: a refusal is no timeout.
        if isinstance(exc, requests.ConnectTimeout) or (
            isinstance(exc, ConnectTimeoutError) and not isinstance(exc, NewConnectionError)
        ):
            error_class, problem = EngineConnectTimeoutError, "did not accept a connection in time"
        elif isinstance(exc, (requests.Timeout, ReadTimeoutError)):
            error_class, problem = EngineTimeoutError, "did not answer within the read timeout"
        elif isinstance(
            exc,
            (
                requests.ConnectionError,
                requests.exceptions.ChunkedEncodingError,
                NewConnectionError,
                ProtocolError,
                ProxyError,
                SSLError,
                OSError,
            ),
        ):
            error_class, problem = EngineConnectionError, "could not be reached or dropped the connection"
        else:
            error_class, problem = EngineError, "request failed"
        message = (
            f"{exchange.method} {exchange.path}{what}: the engine at {self.base_url} {problem} ({detail}); "
            "check base_url, that the engine is running, and the timeout (timeout=, or lora-sampler sample --timeout)"
        )
        return error_class(message, model=model, adapter=adapter)


class _Exchange(NamedTuple):
    """One request to send, and what the error translation needs to know about it."""

    method: str
    path: str
    data: Optional[bytes]
    headers: Dict[str, str]
    timeout: Timeout
    model: Optional[str]
    adapter: bool

    @classmethod
    def post(
        cls,
        path: str,
        payload: Mapping[str, Any],
        session_id: Optional[str],
        timeout: Timeout,
        model: Optional[str],
        adapter: bool,
    ) -> _Exchange:
        """Build a JSON POST, with the routing header when there is a session."""
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers[SESSION_HEADER] = session_id
        return cls("POST", path, json.dumps(payload, separators=(",", ":")).encode(), headers, timeout, model, adapter)
