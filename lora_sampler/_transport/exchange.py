"""One request to send and one answer read whole: the plain values the transport's modules pass each other.

No I/O: building a request (its fresh id, its JSON body, its headers).
"""

from __future__ import annotations

import json
import random
from typing import Any, Dict, Mapping, NamedTuple, Optional

from lora_sampler._wire.routes import REQUEST_ID_HEADER, SESSION_HEADER
from lora_sampler.types import Timeout

#: One encoder for every body (``json.dumps`` with options builds a new one per call): compact, and no NaN on the wire.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def new_id() -> str:
    """Return a fresh random id of 32 hex digits (request and session ids: unique, not secret, no system call)."""
    return f"{random.getrandbits(128):032x}"


class Exchange(NamedTuple):
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
    def get(cls, path: str, timeout: Timeout) -> Exchange:
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
    ) -> Exchange:
        """Build a JSON POST with a fresh request id, and the routing header when there is a session."""
        request_id = new_id()
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
        if session_id:
            headers[SESSION_HEADER] = session_id
        data = _JSON_ENCODER.encode(payload).encode()
        return cls("POST", path, data, headers, timeout, model, adapter, request_id)

    def describe(self) -> str:
        """Return what the request was about, for messages: `` for LoRA adapter 'x'`` or ""."""
        if not self.model:
            return ""
        return f" for {'LoRA adapter' if self.adapter else 'base model'} {self.model!r}"


class Answer(NamedTuple):
    """One HTTP answer, read whole: what the translation reads."""

    status: int
    reason: str
    headers: Mapping[str, str]
    content: bytes

    @classmethod
    def head_of(cls, response: Any) -> Answer:
        """Return the status line and headers of a requests response, with no body (for errors while reading it)."""
        return cls(response.status_code, str(response.reason or ""), response.headers, b"")

    @property
    def content_type(self) -> str:
        """The ``Content-Type`` header, or "" when absent."""
        return str(self.headers.get("Content-Type") or "")

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", "replace")
