"""The FakeEngine's lifecycle: its threads, its connections, its sleeps and its death.

The engine, its adapter table, its slots and its HTTP server share this one object (not the engine's insides):
they pause for a latency read live, kill the engine as vLLM dies, and track the connections and threads ``stop()``
ends. Stdlib only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable

from lora_sampler.testing._observability import EngineStats
from lora_sampler.testing._server import ClientGone, Server, client_gone

_POLL_INTERVAL = 0.05  # how often serve_forever checks for shutdown: bounds how long stop() takes
_PAUSE_STEP = 0.01  # how often a pause re-reads its latency and looks for a client that hung up
_DYING_GRACE = 5.0  # seconds a dying engine lets requests in flight send their 500s


class Lifecycle:
    """Threads, connections, sleeps and death of one engine.

    Args:
        lock: The engine's one lock (shared by the adapter table, the fault script and the stats).
        stats: The engine's counters (connections opened, requests in flight).
    """

    def __init__(self, lock: threading.Lock, stats: EngineStats) -> None:
        self.lock, self.stats = lock, stats
        #: Set on stop and on death: cuts every sleep short.
        self.wake = threading.Event()
        #: What each handler thread serves: its ``connection`` (to see its client hang up) and ``prompts``.
        self.serving = threading.local()
        #: True once the engine core died.
        self.dead = False
        self._server: Server | None = None
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()

    def serve(self, server: Server) -> None:
        """Serve ``server`` in a daemon thread until ``stop()``."""
        self._server = server
        self.spawn(server.serve_forever, _POLL_INTERVAL)

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
                threads = [t for t in self._threads if t.is_alive()]
                self._threads = threads
            if not threads:
                break
            for thread in threads:
                thread.join()

    def track(self, sock: socket.socket, *, opened: bool) -> None:
        """Count and keep an accepted connection (``opened``), or forget a closed one."""
        with self.lock:
            if opened:
                self.stats.opened += 1
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

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``; stop and death end it."""
        if seconds > 0:
            self.wake.wait(seconds)

    def pause(self, seconds: Callable[[], float]) -> None:
        """Sleep ``seconds()``, re-read while sleeping so a test may cut it; stop and death end it.

        Raises:
            ClientGone: the client hung up meanwhile (vLLM aborts a generation whose client went away).
        """
        start = time.monotonic()
        connection = getattr(self.serving, "connection", None)
        while not self.wake.is_set():
            remaining = float(seconds()) - (time.monotonic() - start)
            if remaining <= 0:
                return
            self.wake.wait(min(remaining, _PAUSE_STEP))
            if connection is not None and client_gone(connection):
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
        while self.stats.in_flight and time.monotonic() < deadline:
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
