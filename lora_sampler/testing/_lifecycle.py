"""The FakeEngine's HTTP server and lifecycle: the loopback server and its quiet handler, the threads, the
connections, the sleeps and waits, and the engine's death.

The engine, its adapter table and its hold share one ``Lifecycle`` (not the engine's insides): they pause for a
latency read live, wait on the engine's lock until stop or death, kill the engine as vLLM dies, and it tracks the
connections, the requests in flight and the threads ``stop()`` ends. It makes no routing, fault or adapter decision.
Stdlib only.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from lora_sampler.testing._bodies import VllmBody

_POLL_INTERVAL = 0.05  # how often serve_forever checks for shutdown: bounds how long stop() takes
_PAUSE_STEP = 0.01  # how often a pause or a wait re-reads its condition and looks for a client that hung up
_DYING_GRACE = 5.0  # seconds a dying engine lets requests in flight send their 500s

#: Answers one request: ``(handler, path, raw body)`` to the answer (None: none) and whether to reset the connection.
Answerer = Callable[["Handler", str, bytes], "tuple[VllmBody | None, bool]"]


class ClientGone(Exception):
    """The client closed its connection while its request was being served (vLLM then aborts the request)."""


class Lifecycle:
    """Threads, connections, requests in flight, sleeps, waits and death of one engine.

    Args:
        lock: The engine's one lock (shared by the adapter table, the fault script and the request log).
    """

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        #: The one condition of the lock: notified when a slot, a hold or a held count changes (its waiters re-check).
        self.changed = threading.Condition(lock)
        #: Set on stop and on death: cuts every sleep and wait short.
        self.wake = threading.Event()
        #: What each handler thread serves: its ``connection`` (to see its client hang up) and ``prompts``.
        self.serving = threading.local()
        #: True once the engine core died.
        self.dead = False
        #: Connections accepted (since start or ``reset``), and requests read but not yet answered.
        self.opened = self.in_flight = 0
        self._server: Server | None = None
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()

    def serve(self, address: tuple[str, int], answer: Answerer) -> int:
        """Listen on ``address`` and serve each request with ``answer`` in daemon threads until ``stop()``; return
        the bound port."""
        self._server = Server(address, self, answer)
        self.spawn(self._server.serve_forever, _POLL_INTERVAL)
        return int(self._server.server_address[1])

    def stop(self) -> None:
        """Close the listener and every connection, and join all threads. Idempotent."""
        with self.lock:
            server, self._server = self._server, None
        if server is None:
            return
        self.wake.set()
        _close_listener(server)
        self._close_connections()
        server.server_close()
        while True:
            with self.lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                threads = list(self._threads)
            if not threads:
                break
            for thread in threads:
                thread.join()

    def track(self, sock: socket.socket, *, opened: bool) -> None:
        """Count and keep an accepted connection (``opened``), or forget a closed one."""
        with self.lock:
            if opened:
                self.opened += 1
                self._connections.add(sock)
            else:
                self._connections.discard(sock)

    def spawn(self, target: Any, *args: Any) -> None:
        """Run ``target(*args)`` in a daemon thread that ``stop()`` joins."""
        thread = threading.Thread(target=target, args=args, name=f"FakeEngine-{target.__name__}", daemon=True)
        with self.lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    @contextlib.contextmanager
    def request(self, connection: socket.socket) -> Iterator[None]:
        """Count one request in flight on ``connection`` for the block (its client is watched while it is served)."""
        with self.lock:
            self.in_flight += 1
        self.serving.connection, self.serving.prompts = connection, 0
        try:
            yield
        finally:
            self.serving.connection = None
            with self.lock:
                self.in_flight -= 1

    def pause(self, seconds: Callable[[], float]) -> None:
        """Sleep ``seconds()``, re-read while sleeping so a test may cut it; stop and death end it.

        Raises:
            ClientGone: the client hung up meanwhile (vLLM aborts a generation whose client went away).
        """
        start = time.monotonic()
        while not self.wake.is_set():
            remaining = float(seconds()) - (time.monotonic() - start)
            if remaining <= 0:
                return
            self.wake.wait(min(remaining, _PAUSE_STEP))
            self._check_client()

    def wait_until(self, done: Callable[[], bool]) -> bool:
        """With ``self.changed`` held, wait until ``done()``; False once the engine stopped or died first.

        Raises:
            ClientGone: the client hung up meanwhile (vLLM aborts a request whose client went away).
        """
        while not done():
            if self.wake.is_set():
                return False
            self.changed.wait(_PAUSE_STEP)
            self._check_client()
        return True

    def _check_client(self) -> None:
        """Raise ``ClientGone`` when the client of the request this thread serves hung up: its socket reads as
        closed (end of file or reset)."""
        connection = getattr(self.serving, "connection", None)
        if connection is None:
            return
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            gone = bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # reset, or already closed
            gone = True
        if gone:
            raise ClientGone()

    def die(self) -> None:
        """Kill the engine as vLLM does when an evicted adapter cannot be reloaded."""
        with self.lock:
            if self.dead:
                return
            self.dead = True
        self.wake.set()
        if self._server is not None:
            self.spawn(self._bring_down, self._server)

    def _bring_down(self, server: Server) -> None:
        _close_listener(server)  # from here on, connections are refused
        deadline = time.monotonic() + _DYING_GRACE
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)  # let in-flight requests send their 500s first
        self._close_connections()

    def _close_connections(self) -> None:
        with self.lock:
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked reading the next request


def _close_listener(server: Server) -> None:
    server.shutdown()  # returns at once when serve_forever already ended
    server.socket.close()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # The stdlib backlog of 5 drops bursts of new connections (64 racing clients wait ~1 s for a SYN retry).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], lifecycle: Lifecycle, answer: Answerer) -> None:
        self.lifecycle, self.answer = lifecycle, answer
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
        """Read the body, have the engine answer, then send the answer, or hang up (reset, or closed quietly)."""
        with self.server.lifecycle.request(self.connection):
            answer, reset = self.server.answer(self, self.path.split("?", 1)[0], self._body())
            if answer is not None:
                self.send_response(answer.status)
                if answer.content_type:
                    self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)
                return
            self.close_connection = True
            if reset:  # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer"
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()
                self.connection.close()

    do_POST = do_GET

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                chunk = self.rfile.read(size + 2)[:size]
                if not size:
                    return b"".join(chunks)
                chunks.append(chunk)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""
