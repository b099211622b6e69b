"""A deadline on the whole answer, status line and headers included, enforced at the socket.

``http.client`` reads an answer through ``sock.makefile()`` under a per-read timeout, so a server dripping one byte
per read never trips it. The connection classes here build each response on a reader that cuts every socket wait
to the time left before the answer's deadline; the deadline is set for the calling thread around one exchange.
"""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
from typing import Any, Dict, Optional, Type, cast

import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool


class _Pending(threading.local):
    overall: Optional[float] = None
    read: float = 0.0


_pending = _Pending()


class AnswerDeadline:
    """Bound the answers read on this thread: each must be in by ``read`` seconds after it was asked for.

    Args:
        overall: The monotonic time by which the whole exchange must end (connect included).
        read: The read timeout; the answer's deadline is the earlier of ``overall`` and request sent + ``read``.
    """

    __slots__ = ("_overall", "_read")

    def __init__(self, overall: float, read: float):
        self._overall, self._read = overall, read

    def __enter__(self) -> None:
        _pending.overall, _pending.read = self._overall, self._read

    def __exit__(self, *exc_info: object) -> None:
        _pending.overall = None


class _DeadlineSocketIO(socket.SocketIO):
    """A socket's raw reader (what ``makefile`` builds) whose every wait is cut to the time left before ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__(sock, "rb")
        self._socket = sock
        # As socket.makefile does: the socket stays open while the answer is read after its connection closed.
        sock._io_refs += 1  # type: ignore[attr-defined]
        self._deadline = deadline

    def readinto(self, buffer: Any) -> Optional[int]:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the whole answer did not arrive within the read timeout")
        self._socket.settimeout(left)
        return super().readinto(buffer)


class _DeadlineResponse(http.client.HTTPResponse):
    """``http.client``'s response, read through a ``_DeadlineSocketIO`` while a deadline is pending on this thread."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: Optional[str] = None, url: Any = None):
        super().__init__(cast(socket.socket, _Maker(sock)), debuglevel, method, url)


class _Maker:
    """Stands in for the socket in ``HTTPResponse.__init__``, which only calls ``makefile``."""

    __slots__ = ("_sock",)

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def makefile(self, mode: str) -> Any:
        overall = _pending.overall
        if overall is None:
            return self._sock.makefile("rb")
        deadline = min(overall, time.monotonic() + _pending.read)
        return io.BufferedReader(_DeadlineSocketIO(self._sock, deadline))


class _DeadlineHTTPConnection(HTTPConnection):
    response_class = _DeadlineResponse


class _DeadlineHTTPSConnection(HTTPSConnection):
    response_class = _DeadlineResponse


class _DeadlineHTTPPool(HTTPConnectionPool):
    ConnectionCls = _DeadlineHTTPConnection


class _DeadlineHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _DeadlineHTTPSConnection


_POOL_CLASSES: Dict[str, Type[HTTPConnectionPool]] = {"http": _DeadlineHTTPPool, "https": _DeadlineHTTPSPool}


class DeadlineAdapter(HTTPAdapter):
    """requests' adapter whose pools (direct and through HTTP proxies) read answers under the pending deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOL_CLASSES

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> urllib3.PoolManager:
        manager: urllib3.PoolManager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, urllib3.ProxyManager):  # SOCKS managers keep their own pool classes
            manager.pool_classes_by_scheme = _POOL_CLASSES
        return manager


__all__ = ["AnswerDeadline", "DeadlineAdapter"]
