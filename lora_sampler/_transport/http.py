"""The transport: every request to one engine, as calls that return a parsed value or raise an ``EngineError``.

A facade over one module per job: ``pool`` (the session and its connections), ``deadline``
(the whole answer, headers included, bounded at the socket), ``reader`` (the body, whole and
size-limited) and ``translate`` (the one table from exceptions, statuses and bodies to lora_sampler's errors).
No retries (the pool's own are off, so retries happen in ``retry.py`` only) and no threads.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

from lora_sampler._defaults import DEFAULT_MAX_WORKERS, DEFAULT_TIMEOUT
from lora_sampler._transport.deadline import AnswerDeadline
from lora_sampler._transport.exchange import Answer, Exchange, new_id, pool_timeout
from lora_sampler._transport.pool import POOL_HEADROOM, EnginePool
from lora_sampler._transport.reader import read_whole
from lora_sampler._transport.secrets import Secrets, redact
from lora_sampler._transport.translate import CAUGHT, Translator
from lora_sampler._transport.urls import normalise_base_url, split_base_url, without_userinfo
from lora_sampler._wire.routes import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH
from lora_sampler.types import Timeout

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "POOL_HEADROOM",
    "Answer",
    "EngineTransport",
    "Timeout",
    "new_id",
    "normalise_base_url",
    "redact",
    "without_userinfo",
]

logger = logging.getLogger(__name__)

#: Largest answer read by default (256 MiB); a larger one is refused rather than filling memory.
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024

T = TypeVar("T")


class EngineTransport:
    """Sends single requests to one vLLM engine over one pooled ``requests.Session``.

    Every method returns a parsed value or raises an ``EngineError``: no other class reads a status or a body.

    Args:
        base_url: The engine root, with or without ``/v1``; its path (``http://gw/llm``) is kept on every request.
        api_key: Sent as ``Authorization: Bearer ...`` when given; otherwise a ``user:password@`` in ``base_url``
            (or ``~/.netrc``) is sent as basic auth, as requests would.
        timeout: ``(connect, read)`` seconds, or one number for both. The read timeout bounds the whole answer,
            status line and headers included.
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
        self.base_url, userinfo = split_base_url(base_url)
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._api_key = api_key
        self._pool = EnginePool(self.base_url, api_key=api_key, basic=userinfo, max_workers=max_workers, verify=verify)
        self._translator = Translator(self.base_url, Secrets(api_key, self._pool.basic or userinfo), max_response_bytes)

    @property
    def has_api_key(self) -> bool:
        """Whether requests carry ``Authorization: Bearer`` (the key itself is never exposed)."""
        return bool(self._api_key)

    @property
    def session(self) -> Any:
        """The ``requests.Session`` (its adapter, proxies and TLS settings)."""
        return self._pool.session

    def close(self) -> None:
        """Close every pooled connection now, direct and through proxies."""
        self._pool.close()

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
            parse: Reads the decoded JSON into the caller's value; a ``ValueError`` it raises means the answer
                does not fit and becomes ``EngineProtocolError`` (any other exception is a bug and propagates).

        Raises:
            EngineError: a transport failure, an error status or redirect, or a malformed answer.
        """
        exchange = Exchange.post(path, payload, session_id, timeout or self.timeout, model, adapter)
        return self._translator.decode_json(exchange, self._send(exchange), parse)

    def get_json(
        self, path: str, *, parse: Optional[Callable[[Any], T]] = None, timeout: Optional[Timeout] = None
    ) -> T:
        """GET ``path`` (under base_url) and return the parsed JSON answer (see ``post_json``).

        ``timeout`` overrides the transport's, e.g. for a short probe.
        """
        exchange = Exchange.get(path, timeout or self.timeout)
        return self._translator.decode_json(exchange, self._send(exchange), parse)

    def get_text(self, path: str, *, timeout: Optional[Timeout] = None) -> str:
        """GET ``path`` and return the text of a 2xx answer (vLLM's ``/health`` answers 200 with an empty body).

        Raises:
            EngineError: a transport failure, or an error status or redirect.
        """
        exchange = Exchange.get(path, timeout or self.timeout)
        answer = self._send(exchange)
        self._translator.check_status(exchange, answer)
        return answer.text

    def post_adapter_command(
        self, path: str, adapter: str, payload: Mapping[str, Any], session_id: Optional[str], timeout: Timeout
    ) -> str:
        """POST to an adapter endpoint (load, unload) and return the text of its 2xx answer (they answer plain text).

        Raises:
            EngineError: a transport failure, or an error status or redirect; errors name ``adapter``.
        """
        exchange = Exchange.post(path, payload, session_id, timeout, adapter, True)
        answer = self._send(exchange)
        self._translator.check_status(exchange, answer)
        return answer.text

    def _send(self, exchange: Exchange) -> Answer:
        """Send one request and read the whole answer, status line and headers included, by its deadline.

        The deadline is the earlier of connect + read timeout from now and the read timeout from the request being
        sent: a server dripping its headers or its body cannot stretch an attempt past it.
        """
        connect, read, _ = pool_timeout(exchange.timeout)
        deadline = time.monotonic() + connect + read
        raw = None
        with AnswerDeadline(deadline, read):
            try:
                raw = self._pool.open(exchange)
                content = read_whole(raw, min(deadline, time.monotonic() + read), self.max_response_bytes)
            except CAUGHT as exc:  # the one translation of the libraries' exceptions
                raise self._translator.transport_error(exc, exchange, raw) from None
        return Answer(raw.status, str(raw.reason or ""), raw.headers, content)
