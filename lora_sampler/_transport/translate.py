"""The one translation point: low-level exceptions, statuses and bodies become lora_sampler's values and errors.

``TRANSPORT_ERRORS`` is the table from requests' and urllib3's exceptions to ours, most specific row first (in the
spirit of httpx's ``map_httpcore_exceptions``); ``Translator.transport_error`` applies it to whatever the one
``try`` around the libraries' calls caught (``CAUGHT``). Statuses
go through ``check_status`` and bodies through ``decode_json``. Every message, excerpt and kept body is redacted.
"""

from __future__ import annotations

import io
import json
import re
import socket
from typing import Any, Callable, Optional, Tuple, Type, TypeVar, cast
from urllib.parse import urlsplit

import requests
import urllib3
from requests.structures import CaseInsensitiveDict
from urllib3.exceptions import (
    ConnectTimeoutError,
    DecodeError,
    NewConnectionError,
    ProtocolError,
    ProxyError,
    ReadTimeoutError,
    SSLError,
)

from lora_sampler._json import loads
from lora_sampler._transport.exchange import Answer, Exchange, Secrets, TooLargeError, without_userinfo
from lora_sampler.errors import (
    EngineConnectionError,
    EngineConnectTimeoutError,
    EngineError,
    EngineProtocolError,
    EngineStatusError,
    EngineTimeoutError,
)

T = TypeVar("T")

#: A proxy's failure (refused, or its CONNECT to the engine refused): named before what lies beneath it.
PROXY_ERRORS: Tuple[Type[BaseException], ...] = (requests.exceptions.ProxyError, ProxyError)
#: What each low-level exception means, most specific first: ``(types, our class, what the engine did)``.
#: urllib3's NewConnectionError subclasses ConnectTimeoutError for history's sake: a refusal is no timeout.
TRANSPORT_ERRORS: Tuple[Tuple[Tuple[Type[BaseException], ...], Type[EngineError], str], ...] = (
    (PROXY_ERRORS, EngineConnectionError, "could not be reached, or could not reach the engine"),
    ((NewConnectionError,), EngineConnectionError, "could not be reached"),
    ((requests.ConnectTimeout, ConnectTimeoutError), EngineConnectTimeoutError, "did not accept a connection in time"),
    (
        (requests.Timeout, ReadTimeoutError, socket.timeout),
        EngineTimeoutError,
        "did not answer in full within the read timeout",
    ),
    (
        (requests.exceptions.ContentDecodingError, DecodeError),
        EngineProtocolError,
        "its Content-Encoding does not decode",
    ),
    # requests' exceptions are OSErrors (its ConnectionError, ChunkedEncodingError, InvalidURL): no answer came.
    ((OSError, ProtocolError, SSLError), EngineConnectionError, "could not be reached or dropped the connection"),
    ((urllib3.exceptions.HTTPError,), EngineError, "request failed"),
)
#: urllib3's connection and pool objects as its messages show them, with the separator after them.
_INTERNAL_OBJECT = re.compile(r"(<[\w.]+ object at 0x[0-9a-fA-F]+>|\b\w*HTTPS?Connection(?:Pool)?\([^()]*\))(:\s*)?")
_DECODE_FIX = "check the engine, or the proxy in front of it: it labels its answers with an encoding they lack"
_NO_ANSWER = Answer(0, "", {}, b"")
#: Every exception the transport's calls into the libraries may raise; ``Translator.transport_error`` maps them.
CAUGHT = (requests.RequestException, urllib3.exceptions.HTTPError, OSError, TooLargeError)


def _causes(exc: BaseException) -> Tuple[BaseException, ...]:
    """The exception and those beneath it, outermost first: requests wraps urllib3's error, which wraps the socket's.

    Followed through ``MaxRetryError.reason``, an exception given as the first argument (requests' way), and
    ``__cause__``; at most eight deep.
    """
    chain = [exc]
    while len(chain) < 8:
        current = chain[-1]
        below: Optional[BaseException] = None
        if isinstance(current, urllib3.exceptions.MaxRetryError) and current.reason is not None:
            below = current.reason
        elif current.args and isinstance(current.args[0], BaseException):
            below = current.args[0]
        elif current.__cause__ is not None:
            below = current.__cause__
        if below is None or below in chain:
            break
        chain.append(below)
    return tuple(chain)


def reason(exc: BaseException) -> str:
    """Say what a low-level exception says, without the libraries' internal objects.

    urllib3 puts its connection and pool objects into its messages (``HTTPConnection(host=..., port=...): ...``,
    ``<urllib3.connection.HTTPConnection object at 0x...>: ...``): a user needs the host, which the message names
    already, and the reason (``[Errno 111] Connection refused``), not the class that held the socket.
    """
    text = str(exc) or type(exc).__name__
    text = _INTERNAL_OBJECT.sub("", text)
    return text.strip() or type(exc).__name__


def loads_strict(content: bytes) -> Any:
    """Decode a JSON body strictly: no NaN or Infinity, and no nesting too deep to decode.

    Raises:
        ValueError: it is not JSON, not UTF-8, holds NaN or Infinity, or is nested too deep; the message says which.
    """
    try:
        return loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("a body that is not JSON") from None
    except ValueError as exc:  # NaN, Infinity, or nested too deep
        raise ValueError(f"a body that is not strict JSON ({exc})") from None


class Translator:
    """Builds every error of one engine's transport, with its secrets redacted.

    Args:
        base_url: The printable engine root, named in every message.
        secrets: The credentials to redact.
        proxy: The proxy requests go through ("" when direct), named as what failed or answered in its place.
    """

    def __init__(self, base_url: str, secrets: Secrets, proxy: str = ""):
        self.base_url = base_url
        self.secrets = secrets
        self.proxy = proxy

    def transport_error(self, exc: BaseException, exchange: Exchange, response: Any = None) -> EngineError:
        """Return the ``EngineError`` a low-level exception stands for (the first matching row of the table).

        Args:
            exc: What requests or urllib3 raised (one of ``CAUGHT``); an ``EngineError`` is returned as it is.
            exchange: The request being sent.
            response: The requests response whose body was being read, once its status and headers were in.
        """
        if isinstance(exc, EngineError):
            return exc
        head = None if response is None else Answer(response.status_code, response.reason or "", response.headers, b"")
        if isinstance(exc, TooLargeError):
            fix = "raise max_response_bytes if such answers are expected"
            return self.protocol_error(exchange, head or _NO_ANSWER, str(exc), fix)
        chain = _causes(exc)
        error_class, problem = next(
            (row[1], row[2]) for row in TRANSPORT_ERRORS if any(isinstance(link, row[0]) for link in chain)
        )
        detail = self.secrets.redact(without_userinfo(reason(chain[-1])))
        if error_class is EngineProtocolError:
            return self.protocol_error(exchange, head or _NO_ANSWER, f"a body that {problem} ({detail})", _DECODE_FIX)
        message = f"{exchange.method} {exchange.path}{exchange.describe()}: " + self._unreached(
            problem, detail, any(isinstance(link, PROXY_ERRORS) for link in chain)
        )
        return error_class(message, model=exchange.model, adapter=exchange.adapter, request_id=exchange.request_id)

    def _unreached(self, problem: str, detail: str, proxy_failed: bool) -> str:
        """Say what could not be reached and the fix: the proxy when it failed (base_url is not the thing to check)."""
        if proxy_failed:
            host = urlsplit(self.base_url).hostname
            return (
                f"the proxy {self.proxy or '(from HTTP_PROXY/HTTPS_PROXY)'} for the engine at {self.base_url} "
                f"{problem} ({detail}); check that the proxy runs and reaches the engine, or set NO_PROXY={host} to "
                "reach the engine directly"
            )
        through = f" through the proxy {self.proxy}" if self.proxy else ""
        return (
            f"the engine at {self.base_url}{through} {problem} ({detail}); check base_url, that the engine is "
            "running, and the timeout (timeout=, or lora-sampler sample --timeout)"
        )

    def decode_json(self, exchange: Exchange, answer: Answer, parse: Optional[Callable[[Any], T]]) -> T:
        """Check the status, decode the body and hand it to ``parse``; the result, or the error it stands for.

        ``parse`` raises ``ValueError`` for an answer that does not fit (it becomes ``EngineProtocolError``); any
        other exception it raises is a bug of the parser and propagates as it is.
        """
        self.check_status(exchange, answer)
        try:
            body = loads_strict(answer.content)
        except ValueError as exc:
            raise self.protocol_error(exchange, answer, str(exc)) from None
        if parse is None:
            if not isinstance(body, dict):
                raise self.protocol_error(exchange, answer, f"a JSON {type(body).__name__}, not an object")
            return cast(T, body)
        try:
            return parse(body)
        except ValueError as exc:
            raise self.protocol_error(exchange, answer, f"an answer that does not fit: {exc}") from None

    def check_status(self, exchange: Exchange, answer: Answer) -> None:
        """Raise the error an error status or a redirect stands for; return for 2xx."""
        if 200 <= answer.status < 300:
            return
        response = self._as_response(exchange, answer)
        if 300 <= answer.status < 400:
            target = without_userinfo(str(answer.headers.get("Location") or "(no Location header)"))
            error: EngineStatusError = EngineStatusError(
                f"{exchange.method} {exchange.path}{exchange.describe()}: the engine at {self.base_url} answered "
                f"HTTP {answer.status}, a redirect to {target}, which is not followed; pass the URL the engine "
                "really serves as base_url",
                status=answer.status,
                engine_message=f"redirect to {target}",
                response=response,
                model=exchange.model,
                adapter=exchange.adapter,
            )
        else:
            # The key (or a basic-auth password) is what the secrets hold; an exchange's own headers never carry one.
            error = EngineStatusError.from_response(
                response, model=exchange.model, adapter=exchange.adapter, key_sent=bool(self.secrets), proxy=self.proxy
            )
        error.message = self.secrets.redact(error.message)
        error.engine_message = self.secrets.redact(error.engine_message)
        error.args = (error.message,)
        error.request_id = exchange.request_id
        raise error

    def protocol_error(self, exchange: Exchange, answer: Answer, problem: str, fix: str = "") -> EngineProtocolError:
        """Return the error for an answer that is not what was asked."""
        excerpt = self.secrets.redact(answer.text[:200])
        content_type = answer.content_type or "no Content-Type"
        fix = fix or (
            "check that base_url points at the vLLM server itself (not a proxy's page) and that it serves the "
            "requested model"
        )
        message = (
            f"{exchange.method} {exchange.path}{exchange.describe()}: the engine at {self.base_url} answered "
            f"HTTP {answer.status} ({content_type}) with {self.secrets.redact(problem)}; body starts {excerpt!r}; "
            f"{fix}"
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

    def _as_response(self, exchange: Exchange, answer: Answer) -> requests.Response:
        """Wrap an error answer in a ``requests.Response`` (for ``HTTPError.response``), as requests' adapter would.

        Its body has the secrets redacted, and its ``request`` carries the method, the URL and the request's own
        headers only: no credentials and no prompt reach a hook, a log or an output file through the error.
        """
        url = self.base_url + exchange.path
        response = requests.Response()
        response.status_code = answer.status
        headers = answer.headers.items()
        response.headers = CaseInsensitiveDict({name: self.secrets.redact(value) for name, value in headers})
        # ``Response.raw`` is the documented file-like source of ``content``, ``text`` and ``json()``: the body, read
        # whole and redacted, is handed back through it (as test libraries build their responses).
        response.raw = io.BytesIO(self.secrets.redact_bytes(answer.content) if self.secrets else answer.content)
        response.reason = answer.reason
        response.url = url
        response.encoding = requests.utils.get_encoding_from_headers(response.headers)
        request = requests.PreparedRequest()
        request.method, request.url, request.body = exchange.method, url, None
        request.headers = CaseInsensitiveDict(exchange.headers)  # the request id and routing header, no auth
        response.request = request
        return response
