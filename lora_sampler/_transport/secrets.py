"""The secrets a transport sends, and their removal from every text and body it hands on.

An engine or a proxy may echo request headers in an error body: the bearer key, a basic-auth password, and the
base64 forms they travel in are replaced by ``***`` before any message, excerpt or error body leaves the transport.
"""

from __future__ import annotations

import base64
from typing import List, Optional, Tuple

#: What a secret is replaced with.
REDACTED = "***"


def redact(text: str, secret: Optional[str]) -> str:
    """Replace every occurrence of ``secret`` in ``text`` (an API key must never reach a message or a log)."""
    return text.replace(secret, REDACTED) if secret else text


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
