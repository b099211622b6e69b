"""The transport: every request to the engine, and the one place that turns HTTP answers into results or errors.

Owns URL normalisation (the base_url path kept, ``/v1`` never doubled, userinfo taken out of every printed URL),
the ``requests.Session`` and its connection pool, the auth, request-id and routing headers, reading the answer
under a whole-answer deadline and a size limit, and the translation of every status, body and transport exception
into lora_sampler's values and errors (requests' adapter pattern). No retries (the pool's own are off, so retries
happen in ``retry.py`` only) and no threads.

Speed: ``Session.request`` re-reads the environment (proxies, CA bundle, netrc) and builds cookie jars and hook
tables on every call, which more than doubles the client's CPU per request. The environment is read once per
transport instead, and requests go straight to the session's own pooled ``HTTPAdapter`` connection pool, which is
configured by requests itself (TLS verification, CA bundle, client certificate). The full ``Session`` path is kept
whenever a proxy applies to the engine URL, or when a test library has patched requests' transport (``responses``,
``requests-mock``), so those keep working exactly as with plain requests. Both paths read the answer with the same
code and hand it to the same translation.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, TypeVar, Union, cast
from urllib.parse import unquote, urlsplit, urlunsplit

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

from lora_sampler._defaults import DEFAULT_MAX_WORKERS, DEFAULT_TIMEOUT
from lora_sampler._version import __version__
from lora_sampler._wire.routes import (
    API_PREFIX,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
)
from lora_sampler.errors import (
    EngineConnectionError,
    EngineConnectTimeoutError,
    EngineError,
    EngineProtocolError,
    EngineStatusError,
    EngineTimeoutError,
)
from lora_sampler.types import Timeout as Timeout  # re-exported: the client's annotations read it here
from lora_sampler.types import split_timeout

logger = logging.getLogger(__name__)

#: Extra pooled connections beyond ``max_workers``: proactive loads and callers' own threads run beside the pool.
POOL_HEADROOM = 4
#: Largest answer read by default (256 MiB); a larger one is refused rather than filling memory.
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024
#: Bytes asked for per read of an answer body.
READ_CHUNK_BYTES = 256 * 1024

T = TypeVar("T")

# The transport methods as requests ships them: when a test library patches them, take the full Session path.
_PRISTINE_ADAPTER_SEND = HTTPAdapter.send
_PRISTINE_GET_ADAPTER = requests.Session.get_adapter


def normalise_base_url(base_url: str) -> str:
    """Return the engine root URL: its path kept, no trailing slash, no trailing ``/v1``, no ``user:password@``.

    Raises:
        ValueError: ``base_url`` is not an http(s) URL.
    """
    return _split_base_url(base_url)[0]


def _split_base_url(base_url: str) -> Tuple[str, Optional[Tuple[str, str]]]:
    """Return the printable engine root and the ``(user, password)`` of its userinfo, if any."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        shown = without_userinfo(base_url) if isinstance(base_url, str) else base_url
        raise ValueError(f"base_url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {shown!r}")
    parts = urlsplit(base_url)
    auth = (unquote(parts.username or ""), unquote(parts.password or "")) if "@" in parts.netloc else None
    netloc = parts.netloc.rpartition("@")[2]
    root = urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")
    if root.endswith(API_PREFIX):
        root = root[: -len(API_PREFIX)]
    return root, auth


def without_userinfo(text: str) -> str:
    """Return ``text`` with any ``user:password@`` after its ``scheme://`` taken out (for reprs and messages)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    authority, slash, path = rest.partition("/")
    return scheme + sep + authority.rpartition("@")[2] + slash + path


def redact(text: str, secret: Optional[str]) -> str:
    """Replace every occurrence of ``secret`` in ``text`` (an API key must never reach a message or a log)."""
    return text.replace(secret, "***") if secret else text


class Answer(NamedTuple):
    """One HTTP answer, read whole: what the translation reads."""

    status: int
    reason: str
    headers: Mapping[str, str]
    content: bytes

    @property
    def content_type(self) -> str:
        """The ``Content-Type`` header, or "" when absent."""
        return str(self.headers.get("Content-Type") or "")

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", "replace")


class EngineTransport:
    """Sends single requests to one vLLM engine over one pooled ``requests.Session``.

    Every method returns a parsed value or raises an ``EngineError``: this class is the only place that reads a
    status or a body.

    Args:
        base_url: The engine root, with or without ``/v1``; its path (``http://gw/llm``) is kept on every request.
        api_key: Sent as ``Authorization: Bearer ...`` when given; otherwise a ``user:password@`` in ``base_url``
            (or ``~/.netrc``) is sent as basic auth, as requests would.
        timeout: ``(connect, read)`` seconds, or one number for both. The read timeout bounds the whole answer.
        max_workers: Threads that may use the session at once; the pool keeps that many connections.
        verify: TLS verification: True, False, or a CA bundle path.
        max_response_bytes: Largest answer accepted; a larger one raises ``EngineProtocolError``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str] = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        max_workers: int = DEFAULT_MAX_WORKERS,
        verify: Union[bool, str] = True,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ):
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be an int >= 1, got {max_response_bytes!r}")
        self.base_url, userinfo = _split_base_url(base_url)
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._api_key = api_key
        self._secrets = [s for s in (api_key, userinfo[1] if userinfo else None) if s]
        self._prefix = urlsplit(self.base_url).path
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
            basic = userinfo or requests.utils.get_netrc_auth(self.base_url)
            if basic:
                self._headers["Authorization"] = requests.auth._basic_auth_str(*basic)
        self.session.headers.update(self._headers)
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
        """Close every pooled connection now, direct and through proxies.

        ``Session.close`` forgets the direct pool without closing it (its sockets would stay open until garbage
        collection), so it is closed here first.
        """
        if self._pool is not None:
            self._pool.close()
        self.session.close()

    # -- the calls the package makes ------------------------------------------------------------------------

    def complete(
        self,
        payload: Mapping[str, Any],
        *,
        model: str,
        adapter: bool,
        session_id: Optional[str],
        parse: Callable[[Any], T],
        chat: bool = False,
    ) -> T:
        """Send one ``POST /v1/completions`` (``/v1/chat/completions`` with ``chat``); return ``parse(body)``.

        See ``post_json`` for the errors.
        """
        path = CHAT_COMPLETIONS_PATH if chat else COMPLETIONS_PATH
        return self.post_json(path, payload, model=model, adapter=adapter, session_id=session_id, parse=parse)

    def post_json(
        self,
        path: str,
        payload: Mapping[str, Any],
        *,
        model: Optional[str] = None,
        adapter: bool = False,
        session_id: Optional[str] = None,
        timeout: Optional[Timeout] = None,
        parse: Optional[Callable[[Any], T]] = None,
    ) -> T:
        """POST a JSON body to ``path`` (under base_url) and return the parsed JSON answer.

        Args:
            path: The API path, e.g. ``/v1/completions``.
            payload: The JSON body.
            model: The model or adapter name the request is about (for errors).
            adapter: Whether it is a LoRA adapter request (for errors and the retry table).
            session_id: Sent as ``X-Session-ID`` (router affinity).
            timeout: Overrides the transport's timeout.
            parse: Reads the decoded JSON into the caller's value; a ``ValueError``, ``TypeError``, ``LookupError``
                or ``AttributeError`` it raises means the answer is malformed and becomes ``EngineProtocolError``.

        Raises:
            EngineError: a transport failure, an error status or redirect, or a malformed answer.
        """
        exchange = _Exchange.post(path, payload, session_id, timeout or self.timeout, model, adapter)
        return self._json_result(exchange, self._send(exchange), parse)

    def get_json(
        self, path: str, *, parse: Optional[Callable[[Any], T]] = None, timeout: Optional[Timeout] = None
    ) -> T:
        """GET ``path`` (under base_url) and return the parsed JSON answer (see ``post_json``).

        ``timeout`` overrides the transport's, e.g. for a short probe.
        """
        exchange = _Exchange.get(path, timeout or self.timeout)
        return self._json_result(exchange, self._send(exchange), parse)

    def get_text(self, path: str, *, timeout: Optional[Timeout] = None) -> str:
        """GET ``path`` and return the text of a 2xx answer (vLLM's ``/health`` answers 200 with an empty body).

        Raises:
            EngineError: a transport failure, or an error status or redirect.
        """
        exchange = _Exchange.get(path, timeout or self.timeout)
        answer = self._send(exchange)
        self._check_status(exchange, answer)
        return answer.text

    def post_adapter_command(
        self, path: str, adapter: str, payload: Mapping[str, Any], session_id: Optional[str], timeout: Timeout
    ) -> str:
        """POST to an adapter endpoint (load, unload) and return the text of its 2xx answer (they answer plain text).

        Raises:
            EngineError: a transport failure, or an error status or redirect; errors name ``adapter``.
        """
        exchange = _Exchange.post(path, payload, session_id, timeout, adapter, True)
        answer = self._send(exchange)
        self._check_status(exchange, answer)
        return answer.text

    # -- sending and reading ---------------------------------------------------------------------------------

    def _send(self, exchange: _Exchange) -> Answer:
        """Send one request on the direct pool or through the Session, and read the whole answer."""
        connect, read, pool_timeout = _pool_timeout(exchange.timeout)
        deadline = time.monotonic() + connect + read
        try:
            if self._is_direct():
                assert self._pool is not None
                raw = self._pool.urlopen(
                    exchange.method,
                    self._prefix + exchange.path,
                    body=exchange.data,
                    headers={**self._headers, **exchange.headers},
                    timeout=pool_timeout,
                    retries=False,
                    redirect=False,
                    assert_same_host=False,
                    preload_content=False,
                    release_conn=False,
                )
            else:
                raw = self._session_request(exchange).raw
            content = self._read_whole(raw, exchange, min(deadline, time.monotonic() + read), read)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            if isinstance(exc, EngineError):
                raise
            raise self._translate(exc, exchange) from None
        return Answer(raw.status, str(raw.reason or ""), raw.headers, content)

    def _session_request(self, exchange: _Exchange) -> requests.Response:
        """Send through ``Session.request``: the path for proxies and for patched (mocked) transports."""
        return self.session.request(
            exchange.method,
            self.base_url + exchange.path,
            data=exchange.data,
            headers=exchange.headers,
            timeout=exchange.timeout,
            stream=True,
            allow_redirects=False,
        )

    def _read_whole(self, raw: Any, exchange: _Exchange, deadline: float, read_timeout: float) -> bytes:
        """Read the body in chunks, each socket wait cut to the time left: the read timeout bounds the whole answer.

        Raises:
            EngineTimeoutError: the answer was not complete in time.
            EngineProtocolError: it is larger than ``max_response_bytes``.
        """
        limit = self.max_response_bytes
        declared = raw.headers.get("Content-Length")
        chunks: List[bytes] = []
        size = 0
        finished = shortened = False
        # read1 returns after at most one socket read, so a byte-dripping server meets the deadline check.
        read = getattr(raw, "read1", None) or raw.read
        sock = getattr(getattr(raw, "connection", None), "sock", None)
        # Decode gzip/deflate (requests asks for them on the Session path); skipping the decoder otherwise is faster.
        encoded = "Content-Encoding" in raw.headers
        try:
            if declared and declared.isdigit() and int(declared) > limit:
                raise self._too_large(exchange, raw, f"declares {declared} bytes")
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = requests.ReadTimeout(
                        f"the whole answer took longer than the read timeout ({read_timeout} s)"
                    )
                    raise self._translate(late, exchange)
                if chunks and sock is not None:  # the first read keeps the read timeout urllib3 has just set
                    sock.settimeout(left)
                    shortened = True
                chunk = read(READ_CHUNK_BYTES, decode_content=encoded)
                if not chunk:
                    finished = True
                    break
                size += len(chunk)
                if size > limit:
                    raise self._too_large(exchange, raw, f"sent more than {limit} bytes")
                chunks.append(chunk)
                if raw.length_remaining == 0:  # the declared length is in: no extra read to find the end
                    finished = True
                    break
        finally:
            if not finished:
                raw.close()  # the rest of this answer is unread: the connection cannot be reused
            elif shortened and sock is not None:
                sock.settimeout(read_timeout)  # a reused connection starts with the full timeout again
            raw.release_conn()
        return b"".join(chunks)

    def _too_large(self, exchange: _Exchange, raw: Any, what: str) -> EngineProtocolError:
        return self._protocol_error(
            exchange,
            Answer(raw.status, str(raw.reason or ""), raw.headers, b""),
            f"an answer that {what}, over max_response_bytes={self.max_response_bytes}",
            "raise max_response_bytes if such answers are expected",
        )

    # -- translation: the one place that reads statuses and bodies ------------------------------------------

    def _json_result(self, exchange: _Exchange, answer: Answer, parse: Optional[Callable[[Any], T]]) -> T:
        self._check_status(exchange, answer)
        try:
            body = json.loads(answer.content)
        except ValueError:
            raise self._protocol_error(exchange, answer, "a body that is not JSON") from None
        if parse is None:
            if not isinstance(body, dict):
                raise self._protocol_error(exchange, answer, f"a JSON {type(body).__name__}, not an object")
            return cast(T, body)
        try:
            return parse(body)
        except (ValueError, TypeError, LookupError, AttributeError) as exc:
            raise self._protocol_error(exchange, answer, f"an answer that does not fit: {exc}") from None

    def _check_status(self, exchange: _Exchange, answer: Answer) -> None:
        """Raise the error an error status or a redirect stands for; return for 2xx."""
        if 200 <= answer.status < 300:
            return
        response = self._as_response(exchange, answer)
        if 300 <= answer.status < 400:
            target = without_userinfo(str(answer.headers.get("Location") or "(no Location header)"))
            error: EngineStatusError = EngineStatusError(
                f"{exchange.method} {exchange.path}{_what(exchange)}: the engine at {self.base_url} answered "
                f"HTTP {answer.status}, a redirect to {target}, which is not followed; pass the URL the engine "
                "really serves as base_url",
                status=answer.status,
                engine_message=f"redirect to {target}",
                response=response,
                model=exchange.model,
                adapter=exchange.adapter,
            )
        else:
            error = EngineStatusError.from_response(response, model=exchange.model, adapter=exchange.adapter)
        error.message = self._redact(error.message)
        error.engine_message = self._redact(error.engine_message)
        error.args = (error.message,)
        error.request_id = exchange.request_id
        raise error

    def _protocol_error(self, exchange: _Exchange, answer: Answer, problem: str, fix: str = "") -> EngineProtocolError:
        excerpt = self._redact(answer.text[:200])
        content_type = answer.content_type or "no Content-Type"
        fix = fix or (
            "check that base_url points at the vLLM server itself (not a proxy's page) and that it serves the "
            "requested model"
        )
        message = (
            f"{exchange.method} {exchange.path}{_what(exchange)}: the engine at {self.base_url} answered "
            f"HTTP {answer.status} ({content_type}) with {self._redact(problem)}; body starts {excerpt!r}; {fix}"
        )
        return EngineProtocolError(
            message,
            status=answer.status,
            content_type=answer.content_type,
            body_excerpt=excerpt,
            model=exchange.model,
            adapter=exchange.adapter,
            request_id=exchange.request_id,
        )

    def _as_response(self, exchange: _Exchange, answer: Answer) -> requests.Response:
        """Wrap an answer in a ``requests.Response`` (for ``HTTPError.response``), as requests' adapter would."""
        url = self.base_url + exchange.path
        response = requests.Response()
        response.status_code = answer.status
        response.headers = CaseInsensitiveDict(answer.headers)
        response._content = answer.content
        response.reason = answer.reason
        response.url = url
        response.encoding = requests.utils.get_encoding_from_headers(response.headers)
        request = requests.PreparedRequest()
        request.method, request.url, request.body = exchange.method, url, exchange.data
        request.headers = CaseInsensitiveDict({**self._headers, **exchange.headers})
        response.request = request
        return response

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = redact(text, secret)
        return text

    def _translate(self, exc: Exception, exchange: _Exchange) -> EngineError:
        """Map a ``requests`` or ``urllib3`` exception to the matching ``EngineError``."""
        detail = self._redact(without_userinfo(f"{type(exc).__name__}: {exc}"))
        error_class: type[EngineError]
        # urllib3's NewConnectionError subclasses ConnectTimeoutError for history's sake: a refusal is no timeout.
        if isinstance(exc, requests.ConnectTimeout) or (
            isinstance(exc, ConnectTimeoutError) and not isinstance(exc, NewConnectionError)
        ):
            error_class, problem = EngineConnectTimeoutError, "did not accept a connection in time"
        elif isinstance(exc, (requests.Timeout, ReadTimeoutError)):
            error_class, problem = EngineTimeoutError, "did not answer in full within the read timeout"
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
            f"{exchange.method} {exchange.path}{_what(exchange)}: the engine at {self.base_url} {problem} "
            f"({detail}); check base_url, that the engine is running, and the timeout (timeout=, or lora-sampler "
            "sample --timeout)"
        )
        return error_class(message, model=exchange.model, adapter=exchange.adapter, request_id=exchange.request_id)


@functools.lru_cache(maxsize=32)
def _pool_timeout(timeout: Timeout) -> Tuple[float, float, urllib3.Timeout]:
    """Return ``(connect, read)`` of a pair or a single number, and their urllib3 ``Timeout``, built once per value."""
    connect, read = split_timeout(timeout)
    return connect, read, urllib3.Timeout(connect=connect, read=read)


def _what(exchange: _Exchange) -> str:
    if not exchange.model:
        return ""
    return f" for {'LoRA adapter' if exchange.adapter else 'base model'} {exchange.model!r}"


#: One encoder for every body (``json.dumps`` with options builds a new one per call): compact, and no NaN on the wire.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def new_id() -> str:
    """Return a fresh random id of 32 hex digits (request and session ids: unique, not secret, no system call)."""
    return f"{random.getrandbits(128):032x}"


class _Exchange(NamedTuple):
    """One request to send, and what the error translation needs to know about it."""

    method: str
    path: str
    data: Optional[bytes]
    headers: Dict[str, str]
    timeout: Timeout
    model: Optional[str]
    adapter: bool
    request_id: str

    @classmethod
    def get(cls, path: str, timeout: Timeout) -> _Exchange:
        """Build a GET with a fresh request id."""
        request_id = new_id()
        return cls("GET", path, None, {REQUEST_ID_HEADER: request_id}, timeout, None, False, request_id)

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
        """Build a JSON POST with a fresh request id, and the routing header when there is a session."""
        request_id = new_id()
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
        if session_id:
            headers[SESSION_HEADER] = session_id
        data = _JSON_ENCODER.encode(payload).encode()
        return cls("POST", path, data, headers, timeout, model, adapter, request_id)
