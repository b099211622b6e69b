"""A tiny raw-socket HTTP server for transport faults (resets, half answers, hangs) the FakeEngine cannot fake.

A thread on 127.0.0.1:0 accepts connections and hands each to ``handler(conn, index)``; a context manager.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, List, Optional

Handler = Callable[[socket.socket, int], None]


def read_request(conn: socket.socket) -> bytes:
    """Read one HTTP request (headers plus a Content-Length body) from ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def json_response(body: bytes, status: str = "200 OK") -> bytes:
    """An HTTP/1.1 answer carrying a JSON body, closing the connection."""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


class RawServer:
    """Accepts connections on 127.0.0.1 and runs ``handler`` for each, in order, on one thread."""

    def __init__(self, handler: Handler):
        self._handler = handler
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.requests: List[bytes] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> RawServer:
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        index = 0
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.requests.append(read_request(conn))
                    self._handler(conn, index)
                except OSError:
                    pass
            index += 1
