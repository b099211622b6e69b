"""Engine URLs: the root kept with its path, ``/v1`` never doubled, and userinfo taken out of everything printed.

Pure string work, no I/O.
"""

from __future__ import annotations

from typing import Optional, Tuple
from urllib.parse import unquote, urlsplit, urlunsplit

from lora_sampler._wire.routes import API_PREFIX, ENDPOINT_PATHS


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
