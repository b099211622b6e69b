"""FakeEngine: a loopback stand-in for vLLM's OpenAI server with LoRA adapters (SPEC §7).

Owns the HTTP server, the adapter table with its lazy filesystem resolver and "GPU" LRU, fault
injection and the request log. Bodies come from ``_bodies``; tokens are pseudo-random (there is no
model), and nothing is written to stderr. Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody

COMPLETIONS_PATH = "/v1/completions"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
#: The kinds accepted by ``FakeEngine.inject_fault``.
FAULT_KINDS = frozenset({"refuse", "drop", "hang", "status", "503"})
#: Ids 0-3 are the tiny tokenizer's specials (FINDINGS §2); byte ``b`` of UTF-8 text is id ``4 + b``.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
#: Read by the filesystem resolver and the load endpoint (FINDINGS §2, §4c).
CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_POLL_INTERVAL = 0.05  # how often serve_forever checks for shutdown: bounds how long stop() takes
_NO_TENSORS = "{} doesn't contain tensors"  # the worker's error (FINDINGS §4c, §4d)
_INCOMPLETE = "Error while deserializing header: incomplete metadata, file not fully covered"  # FINDINGS §4c


def encode_text(text: str) -> list[int]:
    """Tokenize ``text`` the fake's way: each UTF-8 byte ``b`` becomes token id ``4 + b`` (no BOS)."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def decode_token(token_id: int) -> str:
    """Return the text of one token: a special, a printable byte, ``<0xHH>``, or `` t<id>`` above the bytes."""
    if token_id < BYTE_OFFSET:
        return SPECIAL_TOKENS[token_id]
    byte = token_id - BYTE_OFFSET
    if byte < 256:
        return chr(byte) if 32 <= byte < 127 else f"<0x{byte:02X}>"
    return f" t{token_id}"


def write_adapter(path: str | os.PathLike[str], base_model: str, *, rank: int = 8, peft_type: str = "LORA") -> str:
    """Write a minimal adapter the fake engine accepts: ``adapter_config.json`` and a valid tiny safetensors file."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": peft_type, "base_model_name_or_path": base_model, "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = ["q_proj", "v_proj"]
    with open(os.path.join(path, CONFIG_NAME), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    tensor = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps({tensor: {"dtype": "F32", "shape": [rank, 4], "data_offsets": [0, rank * 16]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(path, WEIGHT_NAMES[0]), "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + bytes(rank * 16))
    return path


def _safetensors_error(path: str) -> str | None:
    """Return the loader's complaint about a safetensors file, or None when its data covers the header exactly."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                return "Error while deserializing header: HeaderTooSmall"
            (length,) = struct.unpack("<Q", handle.read(8))
            if 8 + length > size:
                return "Error while deserializing header: InvalidHeaderLength"
            header = json.loads(handle.read(length))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return "Error while deserializing header: InvalidHeaderDeserialization"
    if not ends:
        return _NO_TENSORS.format(os.path.dirname(path))
    return None if 8 + length + max(ends) == size else _INCOMPLETE


@dataclass(frozen=True)
class RequestRecord:
    """One request as the engine saw it; ``status`` is 0 when a fault answered nothing.

    ``model`` is the body's ``model`` (``lora_name`` for load/unload). The Authorization value is never kept.
    """

    method: str
    path: str
    model: str | None
    status: int
    session_id: str | None
    has_auth: bool
    started: float
    finished: float
    fault: str | None = None


@dataclass
class _Fault:
    kind: str
    model: str | None
    path: str
    remaining: int
    status: int
    seconds: float
    message: str | None


@dataclass
class _Delay:
    deadline: float | None
    remaining: int | None


@dataclass(frozen=True)
class _Files:
    """What the loader finds in an adapter directory: verdict in absent/json/rank/no_weights/bad_weights/ok."""

    verdict: str
    detail: str = ""
    config: Any = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: FakeEngine) -> None:
        self.engine = engine
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # One daemon thread per connection, tracked by the engine so stop() joins them all (the stdlib's
        # ThreadingMixIn does not track daemon threads).
        self.engine._track(request, opened=True)
        self.engine._spawn(self.process_request_thread, request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.engine._track(request, opened=False)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: clients resetting or vanishing is routine here."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so clients reuse connections
    server_version, sys_version = "uvicorn", ""  # vLLM's server header
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: no stderr line per request."""

    def do_GET(self) -> None:
        self.server.engine._serve(self)

    do_POST = do_GET


class FakeEngine:
    """A real HTTP server on loopback speaking the vLLM subset of SPEC §2 with its verbatim bodies.

    Args:
        model: the base model name (vLLM's ``--model`` string).
        lora_dir: the filesystem resolver's directory; None disables lazy resolution.
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer KEY``.
        runtime_lora_updating: the initial ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` flag.
        max_loras: size of the LRU of adapters in memory; an evicted adapter reloads from disk.
        max_lora_rank: adapters whose config ``r`` exceeds this fail to load.
        max_model_len: context length; ``vocab_size``: token ids must be below it (at least 260).
        latency: seconds of service time per completion; ``load_latency``: seconds per adapter load. Both are
            plain attributes, read while a request sleeps, so a test may change them on a running engine.
        host, port: where to listen (port 0 picks a free one).
        old_error_shape: send error fields at the top level, as older vLLM builds do.
    """

    def __init__(
        self,
        *,
        model: str = "tiny-base",
        lora_dir: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        runtime_lora_updating: bool = True,
        max_loras: int = 4,
        max_lora_rank: int = 8,
        max_model_len: int = 256,
        vocab_size: int = 1024,
        latency: float = 0.0,
        load_latency: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        old_error_shape: bool = False,
    ) -> None:
        if vocab_size < BYTE_OFFSET + 256 or max_model_len < 1 or max_loras < 1:
            raise ValueError("need vocab_size >= 260, max_model_len >= 1 and max_loras >= 1")
        self.model, self.api_key, self.old_error_shape = model, api_key, old_error_shape
        self.lora_dir = None if lora_dir is None else os.fspath(lora_dir)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.latency, self.load_latency, self.host = latency, load_latency, host
        self._requested_port = port
        self._port: int | None = None
        self._runtime_updating = runtime_lora_updating
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set on stop and on death: cuts every sleep short
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._started = self._dead = False
        self._registered: dict[str, str] = {}  # name -> path: the API server's table
        self._cache: OrderedDict[str, str] = OrderedDict()  # the engine's LRU of loaded adapters
        self._name_locks: dict[str, threading.Lock] = {}
        self._delays: dict[str, _Delay] = {}
        self._faults: list[_Fault] = []
        self._connections: set[socket.socket] = set()
        self._records: list[RequestRecord] = []
        self._in_flight = self._opened = self._loads = self._max_loads = self._lazy_loads = 0
        self._loads_by_name: dict[str, int] = {}
        self._max_loads_by_name: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        """Bind and serve in a daemon thread; returns self. An engine starts once."""
        with self._lock:
            if self._started:
                raise RuntimeError("a FakeEngine starts once; create a new one")
            self._started = True
        self._server = _Server((self.host, self._requested_port), self)
        self._port = int(self._server.server_address[1])
        self._spawn(self._server.serve_forever, _POLL_INTERVAL)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and join all threads. Idempotent."""
        with self._lock:
            server, self._server = self._server, None
        if server is None:
            return
        self._wake.set()
        self._close_listener(server)
        self._close_connections()
        server.server_close()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive()]
                self._threads = threads
            if not threads:
                break
            for thread in threads:
                thread.join()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port (still known after stop, so tests can check that it refuses connections)."""
        if self._port is None:
            raise RuntimeError("FakeEngine was never started")
        return self._port

    @property
    def url(self) -> str:
        """The engine root, e.g. ``http://127.0.0.1:PORT`` (no ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def _close_listener(server: _Server) -> None:
        server.shutdown()  # returns at once when serve_forever already ended
        server.socket.close()

    def _close_connections(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked reading the next request

    def _track(self, sock: socket.socket, *, opened: bool) -> None:
        with self._lock:
            if opened:
                self._opened += 1
                self._connections.add(sock)
            else:
                self._connections.discard(sock)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"FakeEngine-{target.__name__}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.wait(seconds)

    def _pause(self, attribute: str) -> None:
        """Sleep ``self.<attribute>`` seconds, re-read while sleeping so a test may cut it; stop and death end it."""
        start = time.monotonic()
        while not self._wake.is_set():
            remaining = float(getattr(self, attribute)) - (time.monotonic() - start)
            if remaining <= 0:
                return
            self._wake.wait(min(remaining, 0.01))

    def _die(self) -> None:
        """Kill the engine as vLLM does when an evicted adapter cannot be reloaded (FINDINGS §5)."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
        self._wake.set()
        if self._server is not None:
            self._spawn(self._bring_down, self._server)

    def _bring_down(self, server: _Server) -> None:
        self._close_listener(server)  # from here on, connections are refused
        deadline = time.monotonic() + 5.0
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.005)  # let in-flight requests send their 500s first
        self._close_connections()

    # -- controls and observability ----------------------------------------------------------------------------------

    def set_runtime_lora_updating(self, on: bool) -> None:
        """Flip ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: off hides load/unload and the resolver (FINDINGS §3, §4d)."""
        self._runtime_updating = bool(on)

    def set_visibility_delay(self, name: str, *, seconds: float | None = None, requests: int | None = None) -> None:
        """Hide ``lora_dir/name`` until ``seconds`` pass or ``requests`` completions for ``name`` were answered."""
        if seconds is None and requests is None:
            raise ValueError("give seconds= or requests=")
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._delays[name] = _Delay(deadline, requests)

    def inject_fault(
        self,
        kind: str,
        *,
        model: str | None = None,
        path: str = COMPLETIONS_PATH,
        count: int = 1,
        status: int = 500,
        seconds: float = 0.0,
        message: str | None = None,
    ) -> None:
        """Script the next ``count`` requests on ``path`` (for ``model``, None = any) to fail as ``kind``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {sorted(FAULT_KINDS)}, not {kind!r}")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._lock:
            self._faults.append(_Fault(kind, model, path, count, status, seconds, message))

    def clear_faults(self) -> None:
        """Drop every scripted fault."""
        with self._lock:
            self._faults.clear()

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, in the order answers were decided."""
        with self._lock:
            return list(self._records)

    def calls(self, path: str, model: str | None = None) -> int:
        """Count logged requests on ``path`` (and for ``model``, when given)."""
        with self._lock:
            return sum(1 for r in self._records if r.path == path and (model is None or r.model == model))

    def reset_log(self) -> None:
        """Clear the request log, the connection count and the load peaks."""
        with self._lock:
            self._records.clear()
            self._opened = self._max_loads = self._lazy_loads = 0
            self._max_loads_by_name.clear()

    @property
    def connections_opened(self) -> int:
        """TCP connections accepted (since start or ``reset_log``)."""
        return self._opened

    @property
    def loads_in_flight(self) -> int:
        """``/v1/load_lora_adapter`` requests being handled now."""
        return self._loads

    @property
    def max_loads_in_flight(self) -> int:
        """Peak of ``loads_in_flight`` over all names."""
        return self._max_loads

    def max_loads_in_flight_for(self, name: str) -> int:
        """Peak number of concurrent ``/v1/load_lora_adapter`` requests for ``name``."""
        with self._lock:
            return self._max_loads_by_name.get(name, 0)

    @property
    def resolver_loads(self) -> int:
        """Adapters loaded lazily by the filesystem resolver (failed resolutions are not counted)."""
        return self._lazy_loads

    @property
    def requests_in_flight(self) -> int:
        """Requests read but not yet answered."""
        return self._in_flight

    @property
    def loaded_adapters(self) -> list[str]:
        """Registered adapter names (the API table, which keeps names evicted from the LRU)."""
        with self._lock:
            return list(self._registered)

    @property
    def cached_adapters(self) -> list[str]:
        """Adapters in the engine's LRU, least recently used first."""
        with self._lock:
            return list(self._cache)

    @property
    def is_dead(self) -> bool:
        """True once the engine core died (FINDINGS §5)."""
        return self._dead

    # -- HTTP plumbing ---------------------------------------------------------------------------------------------

    def _serve(self, handler: _Handler) -> None:
        started = time.monotonic()
        path = handler.path.split("?", 1)[0]
        raw = self._read_body(handler)
        payload: Any = None
        if raw:
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw  # bytes: reported as a bad body by the route
        model = None
        if isinstance(payload, dict):
            value = payload.get("lora_name" if path in (LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH) else "model")
            model = value if isinstance(value, str) else None
        with self._lock:
            self._in_flight += 1
            fault = self._take_fault(path, model)
        try:
            try:
                answer = self._apply_fault(handler, fault) if fault else self._route(handler, path, payload)
            except Exception as exc:  # a bug in the fake: answer it like vLLM's generic handler, visibly
                answer = bodies.error(500, f"FakeEngine internal error: {exc!r}", "InternalServerError")
            status = answer.status if answer is not None else 0
            self._log(handler, path, model, status, started, fault.kind if fault else None)
            if answer is None:
                self._hang_up(handler, reset=fault is not None and fault.kind == "refuse")
            else:
                self._send(handler, answer)
        finally:
            with self._lock:
                self._in_flight -= 1

    @staticmethod
    def _read_body(handler: _Handler) -> bytes:
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

    def _log(
        self, handler: _Handler, path: str, model: str | None, status: int, started: float, fault: str | None
    ) -> None:
        record = RequestRecord(
            method=handler.command,
            path=path,
            model=model,
            status=status,
            session_id=handler.headers.get("X-Session-ID"),
            has_auth="Authorization" in handler.headers,
            started=started,
            finished=time.monotonic(),
            fault=fault,
        )
        with self._lock:  # logged before the answer leaves, so a client never sees it first
            self._records.append(record)
            delay = self._delays.get(model or "")
            if path == COMPLETIONS_PATH and status and delay is not None and delay.remaining is not None:
                delay.remaining -= 1

    @staticmethod
    def _send(handler: _Handler, answer: VllmBody) -> None:
        handler.send_response(answer.status)
        if answer.content_type:
            handler.send_header("Content-Type", answer.content_type)
        handler.send_header("Content-Length", str(len(answer.body)))
        handler.end_headers()
        handler.wfile.write(answer.body)

    @staticmethod
    def _hang_up(handler: _Handler, *, reset: bool) -> None:
        handler.close_connection = True
        if reset:  # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer"
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.rfile.close()
            handler.connection.close()

    def _take_fault(self, path: str, model: str | None) -> _Fault | None:
        for fault in self._faults:
            if fault.path == path and (fault.model is None or fault.model == model):
                fault.remaining -= 1
                if not fault.remaining:
                    self._faults.remove(fault)
                return replace(fault)
        return None

    def _apply_fault(self, handler: _Handler, fault: _Fault) -> VllmBody | None:
        if fault.kind == "status":
            message = fault.message or f"scripted {fault.status}"
            return bodies.error(fault.status, message, _error_type(fault.status), old_shape=self.old_error_shape)
        if fault.kind == "503":
            return bodies.retry_later(old_shape=self.old_error_shape)
        if fault.kind == "hang":
            self._sleep(fault.seconds)
        return None  # refuse, drop, hang: no answer

    def _route(self, handler: _Handler, path: str, payload: Any) -> VllmBody:
        if path in ("/health", "/ping"):
            return VllmBody(503 if self._dead else 200, b"", None)
        if self.api_key is not None and path.startswith("/v1"):
            expected = f"Bearer {self.api_key}"  # vLLM guards /v1 only, /health stays open (ROUTER.md §2)
            got = handler.headers.get("Authorization", "").encode("utf-8", "replace")
            if not secrets.compare_digest(got, expected.encode("utf-8", "replace")):
                return bodies.unauthorized()
        routes = {
            MODELS_PATH: ("GET", self._models),
            COMPLETIONS_PATH: ("POST", self._complete),
            LOAD_ADAPTER_PATH: ("POST", self._load),
            UNLOAD_ADAPTER_PATH: ("POST", self._unload),
        }
        if path not in routes or (path in (LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH) and not self._runtime_updating):
            return bodies.route_not_found()  # the load/unload routes are not registered (FINDINGS §4d)
        method, serve = routes[path]
        if handler.command != method:
            return bodies.method_not_allowed()
        if self._dead:
            return bodies.engine_dead(old_shape=self.old_error_shape)
        if method == "POST" and not isinstance(payload, dict):
            return self._bad("the request body must be a JSON object", "body")
        return serve(payload if isinstance(payload, dict) else {})

    def _bad(self, message: str, param: str | None = None) -> VllmBody:
        return bodies.bad_request(message, param, old_shape=self.old_error_shape)

    # -- adapters ----------------------------------------------------------------------------------------------------

    def _is_visible(self, path: str) -> bool:
        if self.lora_dir is None:
            return True
        name = os.path.relpath(os.path.abspath(path), os.path.abspath(self.lora_dir))
        with self._lock:
            delay = self._delays.get(name)
            if delay is None:
                return True
            due = delay.deadline is not None and time.monotonic() >= delay.deadline
            if due or (delay.remaining is not None and delay.remaining <= 0):
                del self._delays[name]
                return True
            return False

    def _inspect(self, path: str) -> _Files:
        """Read an adapter directory the way vLLM's resolver and worker do (FINDINGS §4c, §4d)."""
        config_path = os.path.join(path, CONFIG_NAME)
        if not self._is_visible(path) or not os.path.isfile(config_path):
            return _Files("absent")
        try:
            with open(config_path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            return _Files("absent")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            return _Files("json", str(exc))
        rank = config.get("r") if isinstance(config, dict) else None
        if isinstance(rank, int) and rank > self.max_lora_rank:
            return _Files("rank", f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", config)
        safetensors, binary = (os.path.join(path, name) for name in WEIGHT_NAMES)
        if os.path.isfile(safetensors):
            problem = _safetensors_error(safetensors)
            return _Files("bad_weights", problem, config) if problem else _Files("ok", "", config)
        if os.path.isfile(binary) and os.path.getsize(binary) > 0:
            return _Files("ok", "", config)
        return _Files("no_weights", _NO_TENSORS.format(path), config)

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._name_locks.setdefault(name, threading.Lock())

    def _register(self, name: str, path: str) -> None:
        with self._lock:
            self._registered[name] = path
            self._cache[name] = path
            self._cache.move_to_end(name)
            while len(self._cache) > self.max_loras:
                self._cache.popitem(last=False)

    def _check_model(self, name: str) -> VllmBody | None:
        """Accept the base or a registered adapter, else try the lazy filesystem resolver (FINDINGS §4a-c)."""
        with self._lock:
            if name == self.model or name in self._registered:
                return None
        missing = bodies.model_not_found(name, self.model, old_shape=self.old_error_shape)
        if not self._runtime_updating or self.lora_dir is None:
            return missing  # without runtime updating the resolver is never consulted (FINDINGS §3)
        with self._name_lock(name):  # vLLM serializes resolution per name, so racing requests load once
            with self._lock:
                if name in self._registered:
                    return None
            path = os.path.join(self.lora_dir, name)
            files = self._inspect(path)
            if files.verdict == "absent":
                return missing
            if files.verdict == "json":
                return bodies.error(400, files.detail, "BadRequestError", old_shape=self.old_error_shape)
            config = files.config if isinstance(files.config, dict) else {}
            if config.get("peft_type") != "LORA" or config.get("base_model_name_or_path") != self.model:
                return missing  # silently ignored by the resolver (FINDINGS §2)
            if files.verdict != "ok":
                return bodies.adapter_not_loadable(name, old_shape=self.old_error_shape)
            self._pause("load_latency")
            self._register(name, path)
            with self._lock:
                self._lazy_loads += 1
            return None

    def _touch(self, name: str) -> VllmBody | None:
        """Use an adapter: reload it from disk when evicted; a failed reload kills the engine (FINDINGS §5)."""
        with self._lock:
            if name == self.model:
                return None
            path = self._registered.get(name)
            if path is None:
                return bodies.model_not_found(name, self.model, old_shape=self.old_error_shape)
            if name in self._cache:
                self._cache.move_to_end(name)
                return None
        if self._inspect(path).verdict != "ok":
            self._die()
            return bodies.engine_dead(old_shape=self.old_error_shape)
        self._pause("load_latency")
        self._register(name, path)
        return None

    def _load(self, payload: dict[str, Any]) -> VllmBody:
        name, path = payload.get("lora_name"), payload.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            field = "lora_path" if isinstance(name, str) else "lora_name"
            return bodies.validation_error(field, len(payload), old_shape=self.old_error_shape)
        if name == self.model:
            return bodies.base_conflict(name, old_shape=self.old_error_shape)
        with self._lock:
            if name in self._registered and not payload.get("load_inplace"):
                return bodies.already_loaded(name, old_shape=self.old_error_shape)
            self._loads += 1
            self._loads_by_name[name] = self._loads_by_name.get(name, 0) + 1
            self._max_loads = max(self._max_loads, self._loads)
            self._max_loads_by_name[name] = max(self._max_loads_by_name.get(name, 0), self._loads_by_name[name])
        try:
            self._pause("load_latency")
            files = self._inspect(path)
        finally:
            with self._lock:
                self._loads -= 1
                self._loads_by_name[name] -= 1
        if files.verdict == "absent":
            return bodies.load_no_adapter(name, path, old_shape=self.old_error_shape)
        if files.verdict == "no_weights":
            return bodies.load_no_weights(path, old_shape=self.old_error_shape)
        if files.verdict != "ok":
            return bodies.worker_failed(files.detail, old_shape=self.old_error_shape)
        self._register(name, path)
        return bodies.load_success(name)

    def _unload(self, payload: dict[str, Any]) -> VllmBody:
        name = payload.get("lora_name")
        if not isinstance(name, str):
            return bodies.validation_error("lora_name", len(payload), old_shape=self.old_error_shape)
        with self._lock:
            if self._registered.pop(name, None) is None:
                return bodies.unload_not_found(name, old_shape=self.old_error_shape)
            self._cache.pop(name, None)
        return bodies.unload_success(name)

    def _models(self, payload: dict[str, Any]) -> VllmBody:
        created = int(time.time())
        with self._lock:
            adapters = list(self._registered.items())
        cards = [bodies.model_card(self.model, self.model, None, self.max_model_len, created)]
        cards += [bodies.model_card(name, path, self.model, None, created) for name, path in adapters]
        return bodies.json_body(200, {"object": "list", "data": cards})

    # -- completions -------------------------------------------------------------------------------------------------

    def _complete(self, payload: dict[str, Any]) -> VllmBody:
        name = payload.get("model") or self.model  # vLLM serves the base when model is omitted
        if not isinstance(name, str):
            return self._bad("model must be a string", "model")
        problem = self._check_model(name)  # before any length check (FINDINGS §4a)
        if problem is not None:
            return problem
        request = _parse_request(payload)
        if isinstance(request, str):
            return self._bad(request)
        if request.max_tokens > self.max_model_len:
            return bodies.max_tokens_too_large(request.max_tokens, self.max_model_len, old_shape=self.old_error_shape)
        if len(request.prompt) > self.max_model_len:
            return bodies.prompt_too_long(self.max_model_len, len(request.prompt), old_shape=self.old_error_shape)
        max_tokens = min(request.max_tokens, self.max_model_len - len(request.prompt))  # clamped (FINDINGS §4e)
        if max_tokens < 1:
            return bodies.max_tokens_zero(old_shape=self.old_error_shape)
        for token_id in request.prompt:
            if not 0 <= token_id < self.vocab_size:
                return bodies.token_out_of_vocab(token_id, old_shape=self.old_error_shape)
        problem = self._touch(name)
        if problem is not None:
            return problem
        self._pause("latency")
        if self._dead:  # in-flight requests share the death (FINDINGS §5)
            return bodies.engine_dead(old_shape=self.old_error_shape)
        sampler = _Sampler(name, request, max_tokens, self.vocab_size)
        choices = [sampler.choice(index) for index in range(request.n)]
        generated = sum(len(sampler.token_ids[index]) for index in range(request.n))
        created = int(time.time())
        return bodies.completion_response(
            f"cmpl-{uuid.uuid4().hex}", created, name, choices, len(request.prompt), generated
        )


def _error_type(status: int) -> str:
    names = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError"}
    return names.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


#: vLLM's default ``--max-logprobs`` (the limit message is vLLM's wording, not in FINDINGS).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class _Request:
    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    logprobs: int | None
    prompt_logprobs: int | None
    return_token_ids: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_request(payload: dict[str, Any]) -> _Request | str:
    """Return the completion parameters the fake honours, or a 400 message."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        prompt = encode_text(prompt)
    elif not (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        return "prompt must be a string or a list of token ids (the fake engine takes one prompt)"
    if not prompt:
        return "Either prompt or prompt_embeds must be provided and non-empty."
    stop = payload.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = payload.get("stop_token_ids") or []
    max_tokens = 16 if payload.get("max_tokens") is None else payload["max_tokens"]
    n, seed, temperature = payload.get("n", 1), payload.get("seed"), payload.get("temperature")
    logprobs, prompt_logprobs = payload.get("logprobs"), payload.get("prompt_logprobs")
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "stop must be a string or a list of strings"
    if not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        return "stop_token_ids must be a list of integers"
    if not (_is_int(n) and n >= 1) or not (_is_int(max_tokens) and max_tokens >= 0):
        return "n must be at least 1 and max_tokens at least 0"
    if not (seed is None or _is_int(seed)) or not (temperature is None or isinstance(temperature, (int, float))):
        return "seed must be an integer and temperature a number"
    for kind, value in (("sample", logprobs), ("prompt", prompt_logprobs)):
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            return f"Requested {kind} logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}"
    return _Request(
        prompt=prompt,
        n=n,
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        return_token_ids=bool(payload.get("return_token_ids")),
    )


class _Sampler:
    """Pseudo-random generation, deterministic in (seed, model, prompt, choice index) when seeded or greedy."""

    def __init__(self, model: str, request: _Request, max_tokens: int, vocab_size: int) -> None:
        self.request, self.max_tokens, self.vocab_size = request, max_tokens, vocab_size
        prompt_key = f"{model}|{','.join(map(str, request.prompt))}"
        self._greedy = request.temperature == 0  # greedy ignores the seed and gives n identical choices
        if self._greedy:
            self._material = f"greedy|{prompt_key}"
        elif request.seed is not None:
            self._material = f"{request.seed}|{prompt_key}"
        else:
            self._material = uuid.uuid4().hex
        self.token_ids: dict[int, list[int]] = {}
        self._prompt_logprobs: list[dict[str, Any] | None] | None = None
        if request.prompt_logprobs is not None:
            self._prompt_logprobs = self._make_prompt_logprobs(prompt_key, request.prompt_logprobs)

    def choice(self, index: int) -> dict[str, Any]:
        """Generate choice ``index``: stop on a stop token id or stop string, else run to ``max_tokens``."""
        material = self._material if self._greedy else f"{self._material}|{index}"
        rng = random.Random(material)
        ids: list[int] = []
        text, finish = "", "length"
        reason: int | str | None = None
        for _ in range(self.max_tokens):
            token = rng.randrange(BYTE_OFFSET, self.vocab_size)  # never a special, so never EOS
            ids.append(token)
            if token in self.request.stop_token_ids:
                finish, reason = "stop", token  # kept in token_ids, not detokenized
                break
            text += decode_token(token)
            hits = [(text.find(stop), stop) for stop in self.request.stop if stop and stop in text]
            if hits:
                cut, stop = min(hits)
                text, finish, reason = text[:cut], "stop", stop
                break
        self.token_ids[index] = ids
        logprobs = None if self.request.logprobs is None else self._logprobs(material, ids, self.request.logprobs)
        with_ids = self.request.return_token_ids
        return bodies.completion_choice(
            index,
            text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=reason,
            token_ids=list(ids) if with_ids else None,
            prompt_logprobs=self._prompt_logprobs,
            prompt_token_ids=list(self.request.prompt) if with_ids else None,
        )

    def _logprobs(self, material: str, ids: list[int], k: int) -> dict[str, Any]:
        """vLLM's completion logprobs; the sampled token is always rank 1, so each dict has max(k, 1) entries."""
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offset = 0
        for step, token in enumerate(ids):
            rng = random.Random(f"{material}|lp|{step}")  # per step, so k does not change other values
            value = -rng.uniform(0.01, 1.0)
            top = {decode_token(token): value}
            alternative = value
            while len(top) < k:
                key = decode_token(rng.randrange(BYTE_OFFSET, self.vocab_size))
                if key not in top:
                    alternative -= rng.uniform(0.05, 1.0)
                    top[key] = alternative
            offsets.append(offset)
            offset += len(decode_token(token))
            tokens.append(decode_token(token))
            values.append(value)
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def _make_prompt_logprobs(self, prompt_key: str, k: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None first, then the top k plus the actual token (k or k+1 entries)."""
        rng = random.Random(f"prompt|{prompt_key}")
        out: list[dict[str, Any] | None] = [None]
        for token in self.request.prompt[1:]:
            rank = rng.randint(1, k + 2)
            values = sorted((-rng.uniform(0.01, 8.0) for _ in range(max(k, rank))), reverse=True)
            entries = {str(token): {"logprob": values[rank - 1], "rank": rank, "decoded_token": decode_token(token)}}
            place = 1
            while place <= k:
                if place == rank:
                    place += 1
                    continue
                other = rng.randrange(BYTE_OFFSET, self.vocab_size)
                if str(other) not in entries:
                    entries[str(other)] = {
                        "logprob": values[place - 1],
                        "rank": place,
                        "decoded_token": decode_token(other),
                    }
                    place += 1
            out.append(entries)
        return out
