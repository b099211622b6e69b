"""FakeEngine's adapters: the files (writing a minimal valid adapter, judging a directory as vLLM's loader does) and
the adapter table, a base class of FakeEngine (registered names, the "GPU" LRU of ``max_loras``, the lazy filesystem
resolver, visibility delays, load/unload, the reload whose failure kills the engine, and the scheduler's
``lora_slots``, with their public controls and counters).

It answers adapter questions only: it does not route, log or script faults; it reads the engine's settings live and
shares the engine's lock. Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from lora_sampler._locks import KeyedLocks
from lora_sampler._wire.archives import has_archive_suffix
from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody

if TYPE_CHECKING:
    from lora_sampler.testing._lifecycle import Lifecycle

#: Read by the filesystem resolver and the load endpoint.
CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_NO_TENSORS = "{} doesn't contain tensors"  # the worker's error
_INCOMPLETE = "Error while deserializing header: incomplete metadata, file not fully covered"  # as vLLM says it


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


def write_adapter_archive(
    path: str | os.PathLike[str], base_model: str, *, rank: int = 8, peft_type: str = "LORA"
) -> str:
    """Write a ready ``.tar.gz`` adapter checkpoint for ``base_model`` (what ``publish`` and ``adapter=`` take).

    The archive holds ``adapter_config.json`` and a valid tiny ``adapter_model.safetensors`` at its top level, as a
    training run saves them; missing parent folders are created. Returns the path.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        write_adapter(folder, base_model, rank=rank, peft_type=peft_type)
        with tarfile.open(path, "w:gz") as tar:
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=name)
    return path


def safetensors_error(path: str) -> str | None:
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
class AdapterFiles:
    """What the loader finds in an adapter directory: verdict in absent/json/rank/no_weights/bad_weights/ok."""

    verdict: str
    detail: str = ""
    config: Any = None


def inspect_adapter(path: str, max_lora_rank: int) -> AdapterFiles:
    """Read an adapter directory the way vLLM's resolver and worker do."""
    try:
        with open(os.path.join(path, CONFIG_NAME), encoding="utf-8", errors="replace") as handle:
            config = json.loads(handle.read())
    except OSError:  # no config file (or a folder of that name, or unreadable)
        return AdapterFiles("absent")
    except json.JSONDecodeError as exc:
        return AdapterFiles("json", str(exc))
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, int) and rank > max_lora_rank:
        return AdapterFiles("rank", f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.", config)
    safetensors, binary = (os.path.join(path, name) for name in WEIGHT_NAMES)
    if os.path.isfile(safetensors):
        problem = safetensors_error(safetensors)
        return AdapterFiles("bad_weights", problem, config) if problem else AdapterFiles("ok", "", config)
    if os.path.isfile(binary) and os.path.getsize(binary) > 0:
        return AdapterFiles("ok", "", config)
    return AdapterFiles("no_weights", _NO_TENSORS.format(path), config)


@dataclass
class _Delay:
    deadline: float | None
    remaining: int | None


#: A content name as publishing makes it: the checkpoint's stem, a dash, hex digits of its content digest.
_CONTENT_NAME = re.compile(r"(.+)-[0-9a-f]{6,64}")


class AdapterTable:
    """FakeEngine's adapters (a base class of it): every adapter state of one engine, under the engine's lock: the
    API server's name table, the engine's LRU of ``max_loras``, the lazy filesystem resolver and its visibility
    delays, the loads in flight, and the scheduler's ``lora_slots``, with the public controls and counters of each.

    It reads the engine's settings (the attributes annotated below, read live: a test may change them), and its
    lifecycle for the pauses of ``load_latency``, ``unload_latency`` and ``swap_latency``, the waits and the death.

    Slots (opt-in, ``lora_slots``): vLLM's scheduler puts requests of at most ``--max-loras`` adapters in a batch. A
    request for an adapter in a slot runs at once; otherwise it waits for a free slot or an idle one (no request
    using it; the least recently used goes), then the adapter is swapped in for ``swap_latency`` seconds, during
    which other requests for it wait too. Every swap is counted (``adapter_swaps``, ``swap_log``).
    """

    model: str
    lora_dir: str | None
    max_loras: int
    max_lora_rank: int
    max_model_len: int
    load_latency: float
    unload_latency: float
    lora_slots: int | None
    swap_latency: float
    _lifecycle: Lifecycle
    _lock: threading.Lock  # the engine's one lock (its lifecycle's)

    def _init_adapters(self, runtime_updating: bool) -> None:
        """Start with no adapter (called by ``FakeEngine.__init__`` once its settings and lifecycle are set)."""
        self._changed = self._lifecycle.changed  # notified when a slot was given back or swapped in
        self._runtime_updating = runtime_updating  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
        self._registered: dict[str, str] = {}  # name -> path: the API server's table
        self._cache: OrderedDict[str, None] = OrderedDict()  # the engine's LRU of loaded names (paths: the table's)
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter in a slot -> requests using it, least recent first
        self._swapping: set[str] = set()
        self._resolving = KeyedLocks()  # one resolution per name at a time; guards no field
        self._delays: dict[str, _Delay] = {}
        self._loading: dict[str, int] = {}  # name -> /v1/load_lora_adapter requests in flight
        #: Counters since start or ``reset_log``: the peaks of loads in flight (all names, and per name), resolver
        #: loads, and the ``(time.monotonic(), adapter)`` of each swap into a slot.
        self._max_loads, self._lazy_loads = 0, 0
        self._max_loads_by_name: dict[str, int] = {}
        self._swaps: list[tuple[float, str]] = []

    # -- queries and controls ----------------------------------------------------------------------------------------

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
    def slotted_adapters(self) -> list[str]:
        """Adapters in slots now (with ``lora_slots``), least recently used first."""
        with self._lock:
            return list(self._slots)

    @property
    def loads_in_flight(self) -> int:
        """``/v1/load_lora_adapter`` requests being handled now."""
        return sum(self._loading.values())

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
    def adapter_swaps(self) -> int:
        """Swaps of an adapter into a slot (with ``lora_slots``; since start or ``reset_log``)."""
        return len(self._swaps)

    @property
    def swap_log(self) -> list[tuple[float, str]]:
        """``(time.monotonic(), adapter)`` of each swap into a slot, oldest first."""
        with self._lock:
            return list(self._swaps)

    def _reset_adapter_counters(self) -> None:
        """Clear the load peaks, the resolver loads and the swaps (not the loads in flight). Called with the lock."""
        self._max_loads = self._lazy_loads = 0
        self._max_loads_by_name.clear()
        self._swaps.clear()

    def set_runtime_lora_updating(self, on: bool) -> None:
        """Flip ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: off hides load/unload and the resolver."""
        self._runtime_updating = bool(on)

    def set_visibility_delay(self, name: str, *, seconds: float | None = None, requests: int | None = None) -> None:
        """Hide ``lora_dir/name`` until ``seconds`` pass or ``requests`` completions for ``name`` were answered.

        ``name`` is an adapter folder name, or a checkpoint's stem: ``"step-1"`` also hides ``step-1-<digest>``, the
        name publishing gives ``step-1.tar.gz`` (whose digest a test does not know before it publishes).

        Raises:
            ValueError: neither ``seconds`` nor ``requests``, or ``name`` is a path or an archive name.
        """
        if seconds is None and requests is None:
            raise ValueError("give seconds= or requests=")
        if not name or "/" in name or os.sep in name or name in (".", "..") or has_archive_suffix(name):
            raise ValueError(
                f"set_visibility_delay takes an adapter name (a folder name in lora_dir, e.g. 'step-1' or "
                f"'step-1-154de9a80e9f'), not {name!r}; a checkpoint's stem also covers the content names publish "
                "gives it"
            )
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._delays[name] = _Delay(deadline, requests)

    def _delay_of(self, name: str) -> tuple[str, _Delay] | None:
        """The delay hiding ``name`` and its key: the name's own, else its stem's (``step-1`` hides the
        content-named ``step-1-<digest>`` that publishing gives ``step-1.tar.gz``). Called with the lock held."""
        delay = self._delays.get(name)
        if delay is not None:
            return name, delay
        match = _CONTENT_NAME.fullmatch(name)
        if match is not None and match.group(1) in self._delays:
            return match.group(1), self._delays[match.group(1)]
        return None

    def _completion_answered(self, model: str | None) -> None:
        """Count an answered completion against ``model``'s request-count delay."""
        with self._lock:
            found = self._delay_of(model or "")
            if found is not None and found[1].remaining is not None:
                found[1].remaining -= 1

    # -- files ---------------------------------------------------------------------------------------------------------

    def _is_visible(self, path: str) -> bool:
        lora_dir = self.lora_dir
        if lora_dir is None:
            return True
        name = os.path.relpath(os.path.abspath(path), os.path.abspath(lora_dir))
        with self._lock:
            found = self._delay_of(name)
            if found is None:
                return True
            key, delay = found
            due = delay.deadline is not None and time.monotonic() >= delay.deadline
            if due or (delay.remaining is not None and delay.remaining <= 0):
                del self._delays[key]
                return True
            return False

    def _inspect(self, path: str) -> AdapterFiles:
        """Read an adapter directory as vLLM does, unless a visibility delay still hides it."""
        if not self._is_visible(path):
            return AdapterFiles("absent")
        return inspect_adapter(path, self.max_lora_rank)

    def _register(self, name: str, path: str) -> None:
        with self._lock:
            self._registered[name] = path
            self._cache[name] = None
            self._cache.move_to_end(name)
            while len(self._cache) > self.max_loras:
                self._cache.popitem(last=False)

    # -- serving -------------------------------------------------------------------------------------------------------

    def _check_model(self, name: str) -> VllmBody | None:
        """Accept the base or a registered adapter, else try the lazy filesystem resolver."""
        with self._lock:
            if name == self.model or name in self._registered:
                return None
        missing = bodies.model_not_found(name, self.model)
        if not self._runtime_updating or self.lora_dir is None:
            return missing  # without runtime updating the resolver is never consulted
        with self._resolving.hold(name):  # vLLM serializes resolution per name, so racing requests load once
            with self._lock:
                if name in self._registered:
                    return None
            path = os.path.join(self.lora_dir, name)
            files = self._inspect(path)
            if files.verdict == "absent":
                return missing
            if files.verdict == "json":
                return bodies.bad_request(files.detail)
            config = files.config if isinstance(files.config, dict) else {}
            if config.get("peft_type") != "LORA" or config.get("base_model_name_or_path") != self.model:
                return missing  # silently ignored by the resolver
            if files.verdict != "ok":
                return bodies.adapter_not_loadable(name)
            self._lifecycle.pause(lambda: self.load_latency)
            self._register(name, path)
            with self._lock:
                self._lazy_loads += 1
            return None

    def _touch(self, name: str) -> VllmBody | None:
        """Use an adapter: reload it from disk when evicted; a failed reload kills the engine."""
        with self._lock:
            if name == self.model:
                return None
            path = self._registered.get(name)
            if path is None:
                return bodies.model_not_found(name, self.model)
            if name in self._cache:
                self._cache.move_to_end(name)
                return None
        if self._inspect(path).verdict != "ok":
            self._lifecycle.die()
            return bodies.engine_dead()
        self._lifecycle.pause(lambda: self.load_latency)
        self._register(name, path)
        return None

    def _load(self, payload: dict[str, Any]) -> VllmBody:
        name, path = payload.get("lora_name"), payload.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            field = "lora_path" if isinstance(name, str) else "lora_name"
            return bodies.validation_error(field, len(payload))
        if name == self.model:
            return bodies.base_conflict(name)
        with self._lock:
            if name in self._registered and not payload.get("load_inplace"):
                return bodies.already_loaded(name)
            self._loading[name] = self._loading.get(name, 0) + 1
            self._max_loads = max(self._max_loads, self.loads_in_flight)
            self._max_loads_by_name[name] = max(self._max_loads_by_name.get(name, 0), self._loading[name])
        try:
            self._lifecycle.pause(lambda: self.load_latency)
            files = self._inspect(path)
        finally:
            with self._lock:
                self._loading[name] -= 1
        if files.verdict == "absent":
            return bodies.load_no_adapter(name, path)
        if files.verdict != "ok":  # the detail of no weights is load_no_weights' too: "<path> doesn't contain tensors"
            return bodies.worker_failed(files.detail)
        self._register(name, path)
        return bodies.load_success(name)

    def _unload(self, payload: dict[str, Any]) -> VllmBody:
        self._lifecycle.pause(lambda: self.unload_latency)
        name = payload.get("lora_name")
        if not isinstance(name, str):
            return bodies.validation_error("lora_name", len(payload))
        with self._lock:
            if self._registered.pop(name, None) is None:
                return bodies.unload_not_found(name)
            self._cache.pop(name, None)
        return bodies.unload_success(name)

    def _models(self, payload: dict[str, Any]) -> VllmBody:
        """``GET /v1/models``: the base model's card, then one per registered adapter."""
        created = int(time.time())
        with self._lock:
            adapters = list(self._registered.items())
        cards = [bodies.model_card(self.model, self.model, None, self.max_model_len, created)]
        cards += [bodies.model_card(name, path, self.model, None, created) for name, path in adapters]
        return bodies.json_body(200, {"object": "list", "data": cards})

    # -- slots -------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_slot(self, name: str) -> Iterator[None]:
        """Hold a slot for ``name`` for the block; no slot for the base model or without ``lora_slots``."""
        held = self.lora_slots is not None and name != self.model and self._acquire(name)
        try:
            yield
        finally:
            if held:
                with self._changed:
                    self._slots[name] -= 1
                    self._changed.notify_all()

    def _acquire(self, name: str) -> bool:
        """Take a slot for ``name`` (swapping it in when it holds none); False once the engine stopped first."""
        with self._changed:
            if not self._lifecycle.wait_until(lambda: self._take_locked(name)):
                return False
            if name not in self._swapping:
                return True
        try:
            self._lifecycle.pause(lambda: self.swap_latency)
        finally:
            with self._changed:
                self._swapping.discard(name)
                self._changed.notify_all()
        return True

    def _take_locked(self, name: str) -> bool:
        """Count a use of ``name``'s slot, evicting an idle adapter when needed; False when it must wait."""
        if name in self._slots:
            if name in self._swapping:
                return False  # being swapped in by another request: wait for it to finish
            self._slots[name] += 1
            self._slots.move_to_end(name)
            return True
        if len(self._slots) >= max(1, int(self.lora_slots or 1)):
            idle = next((held for held, users in self._slots.items() if users == 0), None)
            if idle is None:
                return False
            del self._slots[idle]
        self._slots[name] = 1
        self._swapping.add(name)
        self._swaps.append((time.monotonic(), name))
        return True
