"""The transport: every request to one engine, as calls that return a parsed value or raise an ``EngineError``.

A facade over four modules: ``session`` (the ``requests.Session`` every request goes through, and its adapter),
``connections`` (pooled connections a deadline or Ctrl-C can cut: the watchdog bounds the whole answer, headers
included, by cutting its connection), ``exchange`` (the request and answer values, the URL, the secrets, the body
read whole and size-limited) and ``translate`` (the one table from exceptions, statuses and bodies to
lora_sampler's errors). No retries (the adapter's own are off, so retries happen in ``retry.py`` only); the
transport starts no thread of its own beyond the process's one deadline watchdog.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

import requests

from lora_sampler._defaults import DEFAULT_MAX_WORKERS, DEFAULT_TIMEOUT
from lora_sampler._transport.connections import CUT_DEADLINE, answer_deadline, current_slot, watchdog
from lora_sampler._transport.exchange import LATE, Answer, Exchange, Secrets, read_whole, split_base_url
from lora_sampler._transport.session import EngineSession
from lora_sampler._transport.translate import CAUGHT, Translator
from lora_sampler.types import Timeout, check_count, split_timeout, validated_timeout

logger = logging.getLogger(__name__)

#: Largest answer read by default (256 MiB); a larger one is refused rather than filling memory.
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024

T = TypeVar("T")


class EngineTransport:
    """Sends single requests to one vLLM engine over one ``requests.Session`` (its own, or the user's).

    Every method returns a parsed value or raises an ``EngineError``: no other class reads a status or a body.
    In a child process forked after requests were sent, the transport's own session is made afresh (the parent's
    pooled sockets are the parent's); a user's session cannot be, and is refused there at once.

    Args:
        base_url: The engine root, with or without ``/v1``; its path (``http://gw/llm``) is kept on every request.
        api_key: Sent as ``Authorization: Bearer ...`` when given; otherwise a ``user:password@`` in ``base_url``
            (or ``~/.netrc``) is sent as basic auth, as requests would.
        timeout: ``(connect, read)`` seconds, or one number for both. The read timeout bounds the whole answer,
            status line and headers included.
        max_workers: Threads that may use the session at once; the pool keeps that many connections.
        verify: TLS verification: True, False, or a CA bundle path.
        max_response_bytes: Largest answer accepted; a larger one raises ``EngineProtocolError``.
        session: A ``requests.Session`` of the user's to send through (its adapters, auth, TLS, proxies and
            headers apply); None makes the transport's own.
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
        session: Optional[requests.Session] = None,
    ):
        check_count("max_workers", max_workers, 1)
        check_count("max_response_bytes", max_response_bytes, 1)
        self.base_url, userinfo = split_base_url(base_url)
        self.timeout = validated_timeout(timeout)
        self.max_response_bytes = max_response_bytes
        self._api_key = api_key
        #: Makes the engine session (again in a forked child).
        self._new_session = functools.partial(
            EngineSession, self.base_url, api_key=api_key, basic=userinfo, max_workers=max_workers, verify=verify
        )
        self._engine_session = self._new_session(session=session)
        secrets = Secrets(api_key, self._engine_session.basic or userinfo)
        self._translator = Translator(self.base_url, secrets, self._engine_session.proxy)
        self._pid = os.getpid()

    @property
    def has_api_key(self) -> bool:
        """Whether requests carry ``Authorization: Bearer`` (the key itself is never exposed)."""
        return bool(self._api_key)

    @property
    def session(self) -> requests.Session:
        """The ``requests.Session`` requests go through (its adapter, proxies and TLS settings)."""
        return self._engine_session.session

    @property
    def has_user_session(self) -> bool:
        """Whether requests go through a session the user handed in."""
        return not self._engine_session.owned

    def close(self) -> None:
        """Close every pooled connection now, direct and through proxies (a user's session is left open)."""
        self._engine_session.close()

    def check_process(self) -> None:
        """In a forked child, make the transport's own session afresh; refuse a user's session there.

        The parent's pooled sockets are shared with the child after ``os.fork``: two processes reading one
        connection mix their answers, so the child must never use them.

        Raises:
            RuntimeError: this process is a fork of the one the transport was made in, and the session is the user's.
        """
        if self._pid == os.getpid():
            return
        if not self._engine_session.owned:
            raise RuntimeError(
                "this client sends through a requests.Session you passed as session=, and this process is a fork of "
                "the one that made it: the session's pooled connections belong to the parent. Make the client (and "
                "its session) in the child, or start children with multiprocessing's 'spawn' or 'forkserver' method"
            )
        # The parent's session is dropped without closing it: closing would shut sockets the parent still uses.
        self._engine_session = self._new_session()
        self._pid = os.getpid()

    # -- the calls the package makes ------------------------------------------------------------------------

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
        return self._text(Exchange.get(path, timeout or self.timeout))

    def post_adapter_command(
        self, path: str, adapter: str, payload: Mapping[str, Any], session_id: Optional[str], timeout: Timeout
    ) -> str:
        """POST to an adapter endpoint (load, unload) and return the text of its 2xx answer (they answer plain text).

        Raises:
            EngineError: a transport failure, or an error status or redirect; errors name ``adapter``.
        """
        return self._text(Exchange.post(path, payload, session_id, timeout, adapter, True))

    def _text(self, exchange: Exchange) -> str:
        """Send ``exchange`` and return the text of its 2xx answer (raise the error of any other)."""
        answer = self._send(exchange)
        self._translator.check_status(exchange, answer)
        return answer.text

    def _send(self, exchange: Exchange) -> Answer:
        """Send one request and read the whole answer, status line and headers included, by its deadline.

        The deadline is the earlier of connect + read timeout from now and the read timeout from the request being
        sent: a server dripping its headers or its body cannot stretch an attempt past it (the watchdog shuts the
        connection down then).
        """
        if self._pid != os.getpid():
            self.check_process()
        connect, read = split_timeout(exchange.timeout)
        slot = current_slot()
        guard = watchdog()
        overall = guard.arm(slot, connect, read)
        response: Optional[requests.Response] = None
        try:
            try:
                response = self._engine_session.send(exchange)
                content = read_whole(
                    response.raw, lambda: answer_deadline(slot, overall, read), self.max_response_bytes
                )
            finally:
                guard.disarm(slot)  # no cut can reach the connection once it may serve another thread's request
            if slot.cut != CUT_DEADLINE:
                return Answer(response.status_code, str(response.reason or ""), response.headers, content)
        except CAUGHT as exc:  # the one translation of the libraries' exceptions
            if slot.cut != CUT_DEADLINE:
                raise self._translator.transport_error(exc, exchange, response) from None
        finally:
            if response is not None:  # urllib3's documented call: the connection (closed if unfinished) goes back
                response.raw.release_conn()
        # The watchdog shut the connection down: what it did to the answer (a reset, a short read, a close-delimited
        # body that looks complete) is the deadline passing.
        raise self._translator.transport_error(requests.ReadTimeout(LATE), exchange, response)
