"""Reading one answer body whole, under its deadline and a size limit.

The watchdog (``watchdog.py``) cuts an exchange at its deadline; the check between reads here also covers answers
on connections it cannot cut (a user's own adapters, proxies), one socket read (at most the read timeout) late.
No translation: the caller maps what this raises. No release: the caller gives the connection back once its
exchange is no longer watched.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Tuple

import requests

#: Bytes asked for per read of an answer body.
READ_CHUNK_BYTES = 256 * 1024


class TooLargeError(Exception):
    """The answer is over the size limit; ``what`` says how it showed it."""

    def __init__(self, what: str = ""):
        super().__init__(what)
        self.what = what


def read_whole(raw: Any, deadline: Callable[[], float], limit: int) -> Tuple[bytes, bool]:
    """Read the body of urllib3's response ``raw`` (``Response.raw`` of a streamed requests response) in chunks.

    Args:
        raw: The response, status and headers read, body not.
        deadline: Returns the monotonic time by which the body must be in.
        limit: The largest body accepted.

    Returns:
        The body, and whether it was read to its end (False: the connection cannot be reused and was closed).

    Raises:
        requests.ReadTimeout: the answer was not complete by ``deadline()``.
        TooLargeError: it declares or sends more than ``limit`` bytes.
        urllib3.exceptions.HTTPError, OSError: reading it failed (a reset, a bad encoding).
    """
    declared = raw.headers.get("Content-Length")
    chunks: List[bytes] = []
    size = 0
    finished = False
    # read1 (urllib3 >= 2) returns after at most one socket read, so a byte-dripping server meets the deadline check.
    read = getattr(raw, "read1", None) or raw.read
    # Decode gzip/deflate (requests asks for them); skipping the decoder otherwise is faster.
    encoded = "Content-Encoding" in raw.headers
    try:
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLargeError(f"declares {declared} bytes")
        while True:
            if time.monotonic() >= deadline():
                raise requests.ReadTimeout("the whole answer took longer than the read timeout")
            chunk = read(READ_CHUNK_BYTES, decode_content=encoded)
            if not chunk:
                finished = True
                break
            size += len(chunk)
            if size > limit:
                raise TooLargeError(f"sent more than {limit} bytes")
            chunks.append(chunk)
            if raw.length_remaining == 0:  # the declared length is in: no extra read to find the end
                finished = True
                break
    finally:
        if not finished:
            raw.close()  # the rest of this answer is unread: the connection cannot be reused
    return b"".join(chunks), finished
