"""What goes out and what comes back, as plain values: the engine's URL, the request, the secrets, the answer.

No I/O but reading one answer body whole: building a request (its fresh id, its JSON body, its headers); the engine
root (its path kept, ``/v1`` never doubled, userinfo taken out of everything printed); the secrets a transport sends,
and their removal from every text and body it hands on (an engine or a proxy may echo request headers in an error
body: the bearer key, a basic-auth password, and the base64 forms they travel in are replaced by ``***`` before any
message, excerpt or error body leaves the transport); and the body read under its deadline and a size limit.
"""

from __future__ import annotations

import base64
import json
import random
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple
from urllib.parse import unquote, urlsplit, urlunsplit

import requests

from lora_sampler._wire.routes import API_PREFIX, ENDPOINT_PATHS, REQUEST_ID_HEADER, SESSION_HEADER
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

    @property
    def content_type(self) -> str:
        """The ``Content-Type`` header, or "" when absent."""
        return str(self.headers.get("Content-Type") or "")

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", "replace")


def normalise_base_url(base_url: str) -> str:
    """Return the engine root URL: its path kept, no trailing slash, no trailing ``/v1``, no ``user:password@``.

    Raises:
        ValueError: ``base_url`` is not an http(s) URL.
    """
    return split_base_url(base_url)[0]


def split_base_url(base_url: str) -> Tuple[str, Optional[Tuple[str, str]]]:
    """Return the printable engine root and the ``(user, password)`` of its userinfo, if any.

    Raises:
        ValueError: ``base_url`` is not an http(s) URL, or ends in an endpoint path (``.../v1/completions``).
    """
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        shown = without_userinfo(base_url) if isinstance(base_url, str) else base_url
        raise ValueError(f"base_url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {shown!r}")
    parts = urlsplit(base_url)
    auth = (unquote(parts.username or ""), unquote(parts.password or "")) if "@" in parts.netloc else None
    netloc = parts.netloc.rpartition("@")[2]
    root = urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")
    endpoint = next((path for path in ENDPOINT_PATHS if root.endswith(path)), None)
    if endpoint is not None:
        engine_root = root[: -len(endpoint)]
        raise ValueError(
            f"base_url {without_userinfo(root)!r} ends in the endpoint path {endpoint}; pass the engine root instead, "
            f"{without_userinfo(engine_root)!r} (the client adds each endpoint's path itself)"
        )
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


#: What a secret is replaced with.
REDACTED = "***"


class Secrets:
    """The secret strings of one transport's credentials, longest first, and their redaction.

    Args:
        api_key: The bearer key, when one is sent.
        basic: The ``(user, password)`` sent as basic auth, when there is one.
    """

    def __init__(self, api_key: Optional[str] = None, basic: Optional[Tuple[str, str]] = None):
        found: List[str] = []
        if api_key:
            found += [api_key, _b64(api_key)]
        if basic:
            user, password = basic
            # The header carries base64("user:password"); an echo may also show it decoded, or the password alone.
            found += [_b64(f"{user}:{password}"), f"{user}:{password}" if password else "", password]
        # Longest first: a secret that contains another is replaced whole, not around the shorter one.
        self._secrets = sorted({secret for secret in found if secret}, key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def redact(self, text: str) -> str:
        """Return ``text`` with every secret replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def redact_bytes(self, content: bytes) -> bytes:
        """Return a body with every secret (as UTF-8) replaced by ``***``."""
        for secret in self._secrets:
            content = content.replace(secret.encode("utf-8", "surrogatepass"), REDACTED.encode())
        return content


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8", "surrogatepass")).decode("ascii")


# -- reading one answer body -------------------------------------------------------------------------------------
# The watchdog (``connections.Watchdog``) cuts an exchange at its deadline; the check between reads here also covers
# answers on connections it cannot cut (a user's own adapters, proxies), one socket read (at most the read timeout)
# late. No translation: the caller maps what this raises. No release: the caller gives the connection back once its
# exchange is no longer watched.

#: Bytes asked for per read of an answer body.
READ_CHUNK_BYTES = 256 * 1024
#: What an answer not in by its deadline is told by, whichever part of the transport saw it late.
LATE = "the whole answer did not arrive within the read timeout"


class TooLargeError(Exception):
    """The answer is over the size limit; the message says how it showed it and names the limit."""


def read_whole(raw: Any, deadline: Callable[[], float], limit: int) -> bytes:
    """Read the body of urllib3's response ``raw`` (``Response.raw`` of a streamed requests response) in chunks.

    Args:
        raw: The response, status and headers read, body not.
        deadline: Returns the monotonic time by which the body must be in.
        limit: The largest body accepted.

    Returns:
        The body. When it is not read to its end, the connection is closed (it cannot be reused).

    Raises:
        requests.ReadTimeout: the answer was not complete by ``deadline()`` (``LATE``).
        TooLargeError: it declares or sends more than ``limit`` bytes.
        urllib3.exceptions.HTTPError, OSError: reading it failed (a reset, a bad encoding).
    """
    declared = raw.headers.get("Content-Length")
    chunks: List[bytes] = []
    size = 0
    # read1 (urllib3 >= 2) returns after at most one socket read, so a byte-dripping server meets the deadline check.
    read = getattr(raw, "read1", None) or raw.read
    # Decode gzip/deflate (requests asks for them); skipping the decoder otherwise is faster.
    encoded = "Content-Encoding" in raw.headers
    try:
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLargeError(f"an answer that declares {declared} bytes, over max_response_bytes={limit}")
        while True:
            if time.monotonic() >= deadline():
                raise requests.ReadTimeout(LATE)
            chunk = read(READ_CHUNK_BYTES, decode_content=encoded)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise TooLargeError(f"an answer that sent more than {limit} bytes, over max_response_bytes={limit}")
            chunks.append(chunk)
            if raw.length_remaining == 0:  # the declared length is in: no extra read to find the end
                break
    except BaseException:
        raw.close()  # the rest of this answer is unread: the connection cannot be reused
        raise
    return b"".join(chunks)
