"""A small S3-speaking stand-in on loopback that misbehaves on request: silent, dripping, dropping, changing.

moto (``_s3server.py``) is a faithful S3; this is the opposite: just enough of S3's REST API (path-style HEAD and
GET of an object, ``ListObjectsV2`` with pages and delimiters, ``If-Match``) for botocore and s3fs to talk to it,
and a fault per operation that a test sets:

- ``"silent"``: read the request, never answer;
- ``"drip"``: send the answer (status line, headers and body) one byte per ``drip_interval`` seconds;
- ``"drip-body"``: headers at once, then the body one byte per ``drip_interval``;
- ``"drop"``: headers and half the body, then close the connection;
- ``"loop"`` (listings only): every page says there is more, with the same continuation token;
- ``"endless"`` (listings only): every page says there is more, with a new continuation token each time (the
  pages after the last entry are empty).

``changes`` makes the object change (or vanish) between its HEAD and its GET (the GET's ``If-Match`` then fails with
412, as S3's does, or the GET with 404). Every handler thread ends when the store is stopped; the server binds
127.0.0.1 only.
"""

from __future__ import annotations

import email.utils
import hashlib
import socket
import socketserver
import threading
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple
from xml.sax.saxutils import escape

BUCKET = "ckpts"
#: Modified time every object claims (a fixed instant: the tests compare signatures, not clocks).
MODIFIED = 1_764_547_200.0


class FaultStore:
    """The stand-in server: ``objects`` (key -> bytes) in bucket ``ckpts``, ``faults`` (operation -> mode)."""

    def __init__(self, drip_interval: float = 0.5) -> None:
        self.objects: Dict[str, bytes] = {}
        #: ``{"HEAD" | "GET" | "LIST": mode}``; an operation without an entry is answered normally.
        self.faults: Dict[str, str] = {}
        #: Keys whose object is rewritten (bytes) or deleted (None) right after its HEAD is answered.
        self.changes: Dict[str, Optional[bytes]] = {}
        self.drip_interval = drip_interval
        self.page_size = 1000
        self.requests: List[Tuple[str, str]] = []
        self.stopping = threading.Event()
        store = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                store._serve(self.connection, self.rfile)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultstore", daemon=True)
        self._thread.start()

    def options(self, **extra: object) -> Dict[str, object]:
        """Storage options pointing s3fs at this store with dummy credentials (no AWS account, no metadata)."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            **extra,
        }

    def stop(self) -> None:
        """End every handler (silent and dripping ones too) and the server."""
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # -- the protocol --------------------------------------------------------------------------------------------

    def _serve(self, connection: socket.socket, rfile: object) -> None:
        reader = rfile
        while not self.stopping.is_set():
            try:
                line = reader.readline()  # type: ignore[attr-defined]
            except OSError:
                return
            if not line:
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: Dict[str, str] = {}
            while True:
                header = reader.readline().decode("latin-1")  # type: ignore[attr-defined]
                if header in ("\r\n", "\n", ""):
                    break
                name, _, value = header.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if length:
                reader.read(length)  # type: ignore[attr-defined]
            if not self._answer(connection, method, target, headers):
                return

    def _answer(self, connection: socket.socket, method: str, target: str, headers: Dict[str, str]) -> bool:
        """Answer one request; False when the connection is to be closed."""
        url = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(url.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket != BUCKET:
            return self._send(connection, "GET", 404, {}, _error("NoSuchBucket", "no such bucket"), method == "HEAD")
        if not key and method == "GET" and query.get("list-type") == "2":
            self.requests.append(("LIST", query.get("prefix", "")))
            return self._send(connection, "LIST", 200, {"Content-Type": "application/xml"}, self._listing(query))
        self.requests.append((method, key))
        data = self.objects.get(key)
        if data is None:
            return self._send(connection, method, 404, {}, _error("NoSuchKey", "no such key"), method == "HEAD")
        etag = _etag(data)
        found = {
            "ETag": etag,
            "Last-Modified": email.utils.formatdate(MODIFIED, usegmt=True),
            "Content-Type": "application/octet-stream",
        }
        if method == "HEAD":
            answered = self._send(connection, "HEAD", 200, found, data, head_only=True)
            if key in self.changes:
                changed = self.changes.pop(key)
                if changed is None:
                    del self.objects[key]  # it vanishes
                else:
                    self.objects[key] = changed
            return answered
        if headers.get("if-match") not in (None, etag):
            return self._send(
                connection,
                "GET",
                412,
                {},
                _error("PreconditionFailed", "At least one of the pre-" "conditions you specified did not hold"),
            )
        return self._send(connection, "GET", 200, found, data)

    def _listing(self, query: Dict[str, str]) -> bytes:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        limit = min(int(query.get("max-keys") or 1000), self.page_size)
        token = query.get("continuation-token") or "0"
        start = int(token) if token.isdigit() else 0
        contents: List[str] = []
        commons: List[str] = []
        for key in sorted(self.objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                if common not in commons:
                    commons.append(common)
                continue
            contents.append(key)
        entries = [("key", key) for key in contents] + [("prefix", common) for common in commons]
        page = entries[start : start + limit]
        fault = self.faults.get("LIST")
        more = start + limit < len(entries) or fault in ("loop", "endless")
        token = "same-token" if fault == "loop" else str(start + limit)
        parts = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
            f"<Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>",
            f"<MaxKeys>{limit}</MaxKeys><IsTruncated>{'true' if more else 'false'}</IsTruncated>",
        ]
        if more:
            parts.append(f"<NextContinuationToken>{token}</NextContinuationToken>")
        for kind, name in page:
            if kind == "key":
                data = self.objects[name]
                parts.append(
                    f"<Contents><Key>{escape(name)}</Key><LastModified>2025-12-01T00:00:00.000Z</LastModified>"
                    f"<ETag>{escape(_etag(data))}</ETag><Size>{len(data)}</Size>"
                    "<StorageClass>STANDARD</StorageClass></Contents>"
                )
            else:
                parts.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()

    def _send(
        self,
        connection: socket.socket,
        operation: str,
        status: int,
        headers: Dict[str, str],
        body: bytes,
        head_only: bool = False,
    ) -> bool:
        fault = self.faults.get(operation)
        reason = {200: "OK", 404: "Not Found", 412: "Precondition Failed"}[status]
        lines = [
            f"HTTP/1.1 {status} {reason}",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        payload = b"" if head_only else body
        try:
            if fault == "silent":
                self.stopping.wait()
                return False
            if fault == "drip":
                return self._drip(connection, head + payload)
            connection.sendall(head)
            if fault == "drip-body":
                return self._drip(connection, payload)
            if fault == "drop" and payload:
                connection.sendall(payload[: len(payload) // 2])
                connection.shutdown(socket.SHUT_RDWR)
                return False
            connection.sendall(payload)
        except OSError:
            return False
        return True

    def _drip(self, connection: socket.socket, data: bytes) -> bool:
        for index in range(len(data)):
            if self.stopping.wait(self.drip_interval):
                return False
            connection.sendall(data[index : index + 1])
        return True


def _etag(data: bytes) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'


def _error(code: str, message: str) -> bytes:
    return (
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    )


def count(store: FaultStore, operation: str) -> int:
    """How many requests of ``operation`` ("HEAD", "GET", "LIST") the store was sent."""
    return sum(1 for done, _ in store.requests if done == operation)


def outcome_within(call: Callable[[], Any], bound: float, what: str = "the call") -> Any:
    """Run ``call`` in a thread and return what it returned or raised, asserting it ended within ``bound`` seconds:
    a store call with no bound fails the test instead of hanging it. ``what`` names the call in that failure."""
    outcome: List[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"{what} was still waiting on the store after {bound:.0f} s: it has no bound"
    return outcome[0]
