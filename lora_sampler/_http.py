"""The transport: one HTTP request per call to the engine, and errors translated into lora_sampler's.

Owns URL normalisation (``/v1`` never doubled), the ``requests.Session`` and its connection pool, the auth and
routing headers, and the translation of ``requests`` exceptions (requests' adapter pattern). No retries (the
pool's own are off, so retries happen in ``retry.py`` only) and no threads.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import requests
from requests.adapters import HTTPAdapter

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
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
#: Header vLLM routers hash to pick a replica (ROUTER.md §3a).
SESSION_HEADER = "X-Session-ID"
#: Extra pooled connections beyond ``max_workers``: proactive loads and callers' own threads run beside the pool.
POOL_HEADROOM = 4

Timeout = Union[float, Tuple[float, float]]


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
        self.session.verify = verify
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max_workers + POOL_HEADROOM, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers["User-Agent"] = f"lora-sampler/{__version__}"
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._urls = {
            path: self.base_url + path
            for path in (COMPLETIONS_PATH, LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH, MODELS_PATH)
        }

    def close(self) -> None:
        """Close pooled connections (avoids ResourceWarning on interpreter exit)."""
        self.session.close()

    def complete(self, payload: Mapping[str, Any], *, model: str, adapter: bool, session_id: str) -> Dict[str, Any]:
        """Send one ``POST /v1/completions`` and return the JSON body of a 2xx answer.

        Raises:
            EngineError: a transport failure or an error status, classified for the retry table.
        """
        response = self.post(COMPLETIONS_PATH, payload, model=model, adapter=adapter, session_id=session_id)
        try:
            body = response.json()
        except ValueError:
            raise EngineError(
                f"the engine at {self.base_url} answered HTTP {response.status_code} to {COMPLETIONS_PATH} with a "
                "body that is not JSON; check that base_url points at a vLLM server",
                model=model,
                adapter=adapter,
            ) from None
        if not isinstance(body, dict):
            raise EngineError(f"the engine answered a JSON {type(body).__name__}, not an object", model=model)
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
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers[SESSION_HEADER] = session_id
        data = json.dumps(payload, separators=(",", ":")).encode()
        url = self._urls.get(path) or self.base_url + path
        try:
            response = self.session.post(url, data=data, headers=headers, timeout=timeout or self.timeout)
        except requests.RequestException as exc:
            raise self._translate(exc, "POST", path, model, adapter) from None
        if raise_for_status and response.status_code >= 400:
            raise self._status_error(response, model, adapter)
        return response

    def get(self, path: str) -> requests.Response:
        """Send one GET and return the response.

        Raises:
            EngineError: a transport failure or an error status.
        """
        try:
            response = self.session.get(self._urls.get(path) or self.base_url + path, timeout=self.timeout)
        except requests.RequestException as exc:
            raise self._translate(exc, "GET", path, None, False) from None
        if response.status_code >= 400:
            raise self._status_error(response, None, False)
        return response

    def _status_error(self, response: requests.Response, model: Optional[str], adapter: bool) -> EngineStatusError:
        error = EngineStatusError.from_response(response, model=model, adapter=adapter)
        error.message = redact(error.message, self._api_key)
        error.engine_message = redact(error.engine_message, self._api_key)
        error.args = (error.message,)
        return error

    def _translate(
        self, exc: requests.RequestException, method: str, path: str, model: Optional[str], adapter: bool
    ) -> EngineError:
        """Map a ``requests`` exception to the matching ``EngineError`` (the one place that does it)."""
        what = f" for {'LoRA adapter' if adapter else 'base model'} {model!r}" if model else ""
        detail = redact(f"{type(exc).__name__}: {exc}", self._api_key)
        error_class: type[EngineError]
        if isinstance(exc, requests.ConnectTimeout):
            error_class, problem = EngineConnectTimeoutError, "did not accept a connection in time"
        elif isinstance(exc, requests.Timeout):
            error_class, problem = EngineTimeoutError, "did not answer within the read timeout"
        elif isinstance(exc, (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)):
            error_class, problem = EngineConnectionError, "could not be reached or dropped the connection"
        else:
            error_class, problem = EngineError, "request failed"
        message = (
            f"{method} {path}{what}: the engine at {self.base_url} {problem} ({detail}); "
            "check base_url, that the engine is running, and the timeout"
        )
        return error_class(message, model=model, adapter=adapter)
