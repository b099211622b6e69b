"""The HTTP layer under FakeEngine: the threaded loopback server, its quiet handler and the wire helpers.

Owns reading request bodies and writing or dropping answers; it makes no routing, fault or adapter decision and
only calls into the engine it serves. Stdlib only.
"""

from __future__ import annotations

import select
import socket
import struct
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol

from lora_sampler.testing._bodies import VllmBody


class ConnectionKeeper(Protocol):
    """What the server needs of the engine's lifecycle (``_lifecycle.Lifecycle``): it counts the connections and
    joins the threads ``stop()`` ends."""

    def track(self, sock: socket.socket, *, opened: bool) -> None: ...
    def spawn(self, target: Any, *args: Any) -> None: ...


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # The stdlib backlog of 5 drops bursts of new connections (64 racing clients wait ~1 s for a SYN retry).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], lifecycle: ConnectionKeeper, serve: Callable[[Handler], None]) -> None:
        self.lifecycle = lifecycle
        #: Answers one request (the engine's routing).
        self.serve = serve
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # One daemon thread per connection, tracked by the engine so stop() joins them all (the stdlib's
        # ThreadingMixIn does not track daemon threads).
        self.lifecycle.track(request, opened=True)
        self.lifecycle.spawn(self.process_request_thread, request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.lifecycle.track(request, opened=False)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: clients resetting or vanishing is routine here."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so clients reuse connections
    # Headers and body go out in separate small writes: without TCP_NODELAY, Nagle plus delayed ACK add ~40 ms.
    disable_nagle_algorithm = True
    server_version, sys_version = "uvicorn", ""  # vLLM's server header
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: no stderr line per request."""

    def do_GET(self) -> None:
        self.server.serve(self)

    do_POST = do_GET


def read_body(handler: Handler) -> bytes:
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        chunks: list[bytes] = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            chunk = handler.rfile.read(size + 2)[:size]
            if not size:
                return b"".join(chunks)
            chunks.append(chunk)
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def send(handler: Handler, answer: VllmBody) -> None:
    handler.send_response(answer.status)
    if answer.content_type:
        handler.send_header("Content-Type", answer.content_type)
    handler.send_header("Content-Length", str(len(answer.body)))
    handler.end_headers()
    handler.wfile.write(answer.body)


class ClientGone(Exception):
    """The client closed its connection while its request was being served (vLLM then aborts the request)."""


def client_gone(connection: socket.socket) -> bool:
    """Tell, without blocking, whether the client hung up: its socket reads as closed (end of file or reset)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


def hang_up(handler: Handler, *, reset: bool) -> None:
    handler.close_connection = True
    if reset:  # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer"
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.rfile.close()
        handler.connection.close()
