"""The secrets a transport sends, and their removal from every text and body it hands on.

An engine or a proxy may echo request headers in an error body: the bearer key and a basic-auth password are
replaced by ``***`` before any message or excerpt leaves the transport.
"""

from __future__ import annotations

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
            found.append(api_key)
        if basic:
            found.append(basic[1])
        # Longest first: a secret that contains another is replaced whole, not around the shorter one.
        self._secrets = sorted({secret for secret in found if secret}, key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def redact(self, text: str) -> str:
        """Return ``text`` with every secret replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text
