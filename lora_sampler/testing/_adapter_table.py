"""FakeEngine's adapter table: registered names, the "GPU" LRU of ``max_loras``, the lazy filesystem resolver,
visibility delays, load/unload and the reload whose failure kills the engine.

It answers adapter questions only: it does not route, log, script faults, parse adapter files or run the engine's
lifecycle; it reads the engine's settings live and shares the engine's lock. Stdlib only.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lora_sampler._locks import KeyedLocks
from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._adapters import AdapterFiles, inspect_adapter
from lora_sampler.testing._bodies import VllmBody

if TYPE_CHECKING:
    from lora_sampler.testing._lifecycle import Lifecycle


class AdapterSettings(Protocol):
    """The engine settings the table reads live (``FakeEngine``'s attributes, which a test may change)."""

    @property
    def model(self) -> str: ...
    @property
    def lora_dir(self) -> str | None: ...
    @property
    def max_loras(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def old_error_shape(self) -> bool: ...
    @property
    def load_latency(self) -> float: ...
    @property
    def unload_latency(self) -> float: ...


@dataclass
class _Delay:
    deadline: float | None
    remaining: int | None


#: A content name as publishing makes it: the checkpoint's stem, a dash, hex digits of its content digest.
_CONTENT_NAME = re.compile(r"(.+)-[0-9a-f]{6,64}")
#: Checkpoint archive endings: a delay names an adapter folder, not the archive it comes from.
_ARCHIVE_ENDINGS = (".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tar.xz")


class AdapterTable:
    """The API server's name table plus the engine's LRU. ``runtime_updating`` is the
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` flag; ``engine`` supplies the settings, ``lifecycle`` the pauses for
    ``load_latency`` and ``unload_latency`` and the engine's death.
    """

    def __init__(self, engine: AdapterSettings, lifecycle: Lifecycle, *, runtime_updating: bool) -> None:
        self._engine, self._lifecycle = engine, lifecycle
        self._lock, self._stats = lifecycle.lock, lifecycle.stats
        self.runtime_updating = runtime_updating
        self._registered: dict[str, str] = {}  # name -> path: the API server's table
        self._cache: OrderedDict[str, str] = OrderedDict()  # the engine's LRU of loaded adapters
        self._resolving = KeyedLocks()  # one resolution per name at a time; guards no field
        self._delays: dict[str, _Delay] = {}

    # -- queries and controls ----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        with self._lock:
            return list(self._registered)

    def cached(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    def set_visibility_delay(self, name: str, seconds: float | None, requests: int | None) -> None:
        if seconds is None and requests is None:
            raise ValueError("give seconds= or requests=")
        if not name or "/" in name or os.sep in name or name in (".", "..") or name.endswith(_ARCHIVE_ENDINGS):
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

    def completion_answered(self, model: str | None) -> None:
        """Count an answered completion against ``model``'s request-count delay."""
        with self._lock:
            found = self._delay_of(model or "")
            if found is not None and found[1].remaining is not None:
                found[1].remaining -= 1

    # -- files ---------------------------------------------------------------------------------------------------------

    def _is_visible(self, path: str) -> bool:
        lora_dir = self._engine.lora_dir
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
        return inspect_adapter(path, self._engine.max_lora_rank)

    def _register(self, name: str, path: str) -> None:
        with self._lock:
            self._registered[name] = path
            self._cache[name] = path
            self._cache.move_to_end(name)
            while len(self._cache) > self._engine.max_loras:
                self._cache.popitem(last=False)

    # -- serving -------------------------------------------------------------------------------------------------------

    def check_model(self, name: str) -> VllmBody | None:
        """Accept the base or a registered adapter, else try the lazy filesystem resolver."""
        engine = self._engine
        with self._lock:
            if name == engine.model or name in self._registered:
                return None
        missing = bodies.model_not_found(name, engine.model, old_shape=engine.old_error_shape)
        if not self.runtime_updating or engine.lora_dir is None:
            return missing  # without runtime updating the resolver is never consulted
        with self._resolving.hold(name):  # vLLM serializes resolution per name, so racing requests load once
            with self._lock:
                if name in self._registered:
                    return None
            path = os.path.join(engine.lora_dir, name)
            files = self._inspect(path)
            if files.verdict == "absent":
                return missing
            if files.verdict == "json":
                return bodies.error(400, files.detail, "BadRequestError", old_shape=engine.old_error_shape)
            config = files.config if isinstance(files.config, dict) else {}
            if config.get("peft_type") != "LORA" or config.get("base_model_name_or_path") != engine.model:
                return missing  # silently ignored by the resolver
            if files.verdict != "ok":
                return bodies.adapter_not_loadable(name, old_shape=engine.old_error_shape)
            self._lifecycle.pause(lambda: engine.load_latency)
            self._register(name, path)
            with self._lock:
                self._stats.lazy_loads += 1
            return None

    def touch(self, name: str) -> VllmBody | None:
        """Use an adapter: reload it from disk when evicted; a failed reload kills the engine."""
        engine = self._engine
        with self._lock:
            if name == engine.model:
                return None
            path = self._registered.get(name)
            if path is None:
                return bodies.model_not_found(name, engine.model, old_shape=engine.old_error_shape)
            if name in self._cache:
                self._cache.move_to_end(name)
                return None
        if self._inspect(path).verdict != "ok":
            self._lifecycle.die()
            return bodies.engine_dead(old_shape=engine.old_error_shape)
        self._lifecycle.pause(lambda: engine.load_latency)
        self._register(name, path)
        return None

    def load(self, payload: dict[str, Any]) -> VllmBody:
        engine = self._engine
        name, path = payload.get("lora_name"), payload.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            field = "lora_path" if isinstance(name, str) else "lora_name"
            return bodies.validation_error(field, len(payload), old_shape=engine.old_error_shape)
        if name == engine.model:
            return bodies.base_conflict(name, old_shape=engine.old_error_shape)
        with self._lock:
            if name in self._registered and not payload.get("load_inplace"):
                return bodies.already_loaded(name, old_shape=engine.old_error_shape)
            self._stats.load_started_locked(name)
        try:
            self._lifecycle.pause(lambda: engine.load_latency)
            files = self._inspect(path)
        finally:
            with self._lock:
                self._stats.load_finished_locked(name)
        if files.verdict == "absent":
            return bodies.load_no_adapter(name, path, old_shape=engine.old_error_shape)
        if files.verdict == "no_weights":
            return bodies.load_no_weights(path, old_shape=engine.old_error_shape)
        if files.verdict != "ok":
            return bodies.worker_failed(files.detail, old_shape=engine.old_error_shape)
        self._register(name, path)
        return bodies.load_success(name)

    def unload(self, payload: dict[str, Any]) -> VllmBody:
        self._lifecycle.pause(lambda: self._engine.unload_latency)
        name = payload.get("lora_name")
        if not isinstance(name, str):
            return bodies.validation_error("lora_name", len(payload), old_shape=self._engine.old_error_shape)
        with self._lock:
            if self._registered.pop(name, None) is None:
                return bodies.unload_not_found(name, old_shape=self._engine.old_error_shape)
            self._cache.pop(name, None)
        return bodies.unload_success(name)

    def models(self, payload: dict[str, Any]) -> VllmBody:
        """``GET /v1/models``: the base model's card, then one per registered adapter."""
        engine = self._engine
        created = int(time.time())
        with self._lock:
            adapters = list(self._registered.items())
        cards = [bodies.model_card(engine.model, engine.model, None, engine.max_model_len, created)]
        cards += [bodies.model_card(name, path, engine.model, None, created) for name, path in adapters]
        return bodies.json_body(200, {"object": "list", "data": cards})
