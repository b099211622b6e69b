"""Which adapters this client knows: resolution of ``adapter=`` values, publish-once, preflight, lineages.

Turns an ``adapter=`` value into an ``Adapter`` (publishing a checkpoint path once per client, however many
threads ask), checks each adapter's config against the engine's model once, and retires older adapters of a
lineage. It touches no file itself, and sends only ``GET /v1/models`` and unload requests.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Counter, Dict, List, Mapping, Optional, Set, Tuple, Union

from lora_sampler._adapters.extract import PublishLimits
from lora_sampler._adapters.fleet import Fleet
from lora_sampler._adapters.lease import Lease, hold
from lora_sampler._adapters.lookup import adapter_ids, find_adapter
from lora_sampler._adapters.storage import StorageOptions
from lora_sampler._locks import KeyedLocks
from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.answers import model_cards
from lora_sampler._wire.messages import unload_adapter_body
from lora_sampler._wire.refusals import is_not_held
from lora_sampler._wire.routes import MODELS_PATH, UNLOAD_ADAPTER_PATH
from lora_sampler.errors import AdapterConfigError, EngineError, EngineStatusError, LoraSamplerError
from lora_sampler.names import validate_adapter_name
from lora_sampler.types import Adapter, AdapterSpec, is_checkpoint_path, is_storage_url

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


class AdapterRegistry:
    """Per-client adapter bookkeeping.

    Locking: every field is written under ``_lock``, and read under it except single-key lookups on the sampling
    path (a dict or set lookup is atomic). ``_resolving`` serialises the slow work of one ``adapter=`` value's
    resolution, ``_reading_base`` the engine's base cards' one read; they guard no field.

    Args:
        transport: The engine transport (for ``GET /v1/models`` and unloads).
        lora_base_dir: The resolver directory as this machine sees it, or None.
        engine_lora_base_dir: The same directory as the engine sees it; defaults to ``lora_base_dir``.
        publish_limits: Bounds for every publish (``publish.PublishLimits``); None for the defaults.
        fleet: The replicas to load on after a publish and to unload from, or None for the one engine.
        storage_options: Options of the storage library for checkpoint URLs (``s3://``, ``gs://``), or None; kept
            with the transport's timeout, which bounds every storage request (``storage.StorageOptions``).
    """

    def __init__(
        self,
        transport: EngineTransport,
        lora_base_dir: Optional[PathLike],
        engine_lora_base_dir: Optional[PathLike],
        publish_limits: Optional[PublishLimits] = None,
        *,
        fleet: Optional[Fleet] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
    ):
        self._transport = transport
        #: The storage library's options for checkpoint URLs (publishing, and a sweep's listing), or None.
        self.storage_options = StorageOptions(storage_options, timeout=transport.timeout)
        self._fleet = fleet
        self.publish_limits = publish_limits if publish_limits is not None else PublishLimits()
        self.lora_base_dir = os.path.abspath(os.fspath(lora_base_dir)) if lora_base_dir is not None else None
        engine_dir = engine_lora_base_dir if engine_lora_base_dir is not None else self.lora_base_dir
        self.engine_lora_base_dir = os.fspath(engine_dir) if engine_dir is not None else None
        self._lock = threading.Lock()
        self._resolving = KeyedLocks()
        #: What each ``adapter=`` value resolved to, by its key (``_key_of``): a checkpoint published, a name found.
        self._resolved: Dict[str, Adapter] = {}
        self._checked: Set[str] = set()
        self._base: Optional[List[Tuple[str, str, int]]] = None  # the base cards: (id, root, max_model_len or 0)
        self._reading_base = threading.Lock()
        self._in_flight: Counter[str] = collections.Counter()
        self._lineage_of: Dict[str, str] = {}
        self._lineages: Dict[str, List[str]] = {}
        self._newest_served: Dict[str, int] = {}
        self._retired: Set[str] = set()
        self._leases: Dict[str, Lease] = {}  # adapter name -> this client's lease on its published folder

    # -- resolution -----------------------------------------------------------------------------------------

    def resolve(self, spec: AdapterSpec) -> Adapter:
        """Turn an ``adapter=`` value into an ``Adapter``, publishing and preflighting on first use."""
        if isinstance(spec, Adapter):
            adapter = spec
            validate_adapter_name(adapter.name, argument="adapter")  # its name is a path and the wire's model field
        else:
            key = _key_of(spec)
            adapter = self._resolved.get(key) or self._resolve_once(spec, key)
        self._preflight(adapter)
        return adapter

    def _resolve_once(self, spec: Union[str, PathLike], key: str) -> Adapter:
        """Publish a checkpoint path, or find a bare name, once however many threads ask for it at once.

        An adapter with a folder is remembered only while this client still leases it: an unload that came meanwhile
        let go of it (and maybe deleted it), so the next resolve publishes or finds it again.
        """
        with self._resolving.hold(key):
            with self._lock:
                adapter = self._resolved.get(key)
            if adapter is None:
                adapter = self.publish(spec) if is_checkpoint_path(spec) else self._find(key)
                with self._lock:
                    if adapter.path is None or adapter.name in self._leases:
                        self._resolved[key] = adapter
            return adapter

    def _find(self, name: str) -> Adapter:
        validate_adapter_name(name, argument="adapter")  # before the engine or lora_base_dir ever sees it
        # Looked up once per name: lora_base_dir is often a network mount, where a stat per request costs. Without
        # lora_base_dir the engine's own resolver folder may hold the name, so it is sent as given.
        adapter = find_adapter(name, self.lora_base_dir, self._transport) if self.lora_base_dir else Adapter(name)
        if adapter.path is not None:
            self._lease(adapter.name)
        return adapter

    def engine_path(self, adapter: Adapter) -> Optional[str]:
        """Return the ``lora_path`` to send in a load request, as the engine sees it, or None when unknown."""
        if self.engine_lora_base_dir is not None:
            return os.path.join(self.engine_lora_base_dir, adapter.name)
        return adapter.path

    def unwatched_folder_fix(self, name: str) -> str:
        """The fix when the engine never served an adapter whose folder is in ``lora_base_dir``; "" for any other.

        The adapter is there (published, or found), so the engine does not read that folder: its resolver watches
        another one (``VLLM_LORA_RESOLVER_CACHE_DIR``), or sees it under another path, and runtime loading is off.
        """
        if self.lora_base_dir is None or not os.path.isdir(os.path.join(self.lora_base_dir, name)):
            return ""
        seen = self.engine_lora_base_dir
        where = "" if seen == self.lora_base_dir else f" (sent to the engine as {seen})"
        return (
            f"Its folder {name} is in lora_base_dir {self.lora_base_dir}{where}, but the engine never served it: the "
            "engine may not watch that folder (its VLLM_LORA_RESOLVER_CACHE_DIR must be this folder as the engine "
            "sees it) and cannot load it at runtime; run lora-sampler doctor --base-url "
            f"{self._transport.base_url} --lora-base-dir {self.lora_base_dir} to see which"
        )

    def storage_options_for(self, options: Optional[Mapping[str, Any]] = None) -> StorageOptions:
        """``options`` (None: the registry's own) held to the transport's timeout, as every store request is."""
        if options is None:
            return self.storage_options
        return StorageOptions(options, timeout=self.storage_options.timeout)

    def publish(
        self,
        checkpoint: PathLike,
        *,
        name: Optional[str] = None,
        lineage: Optional[str] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> Adapter:
        """Publish ``checkpoint`` into the resolver directory and preflight it (see ``SamplerClient.publish``)."""
        from lora_sampler._adapters.publish import publish_checkpoint

        if self.lora_base_dir is None:
            raise ValueError("publishing a checkpoint needs lora_base_dir= (the engine's resolver directory)")
        options = self.storage_options_for(storage_options)
        for _ in range(2):  # a second time when another run's clean-up removed the folder before it was leased
            adapter = publish_checkpoint(
                checkpoint, self.lora_base_dir, name=name, limits=self.publish_limits, storage_options=options
            )
            self._lease(adapter.name)
            if adapter.path is None or os.path.isdir(adapter.path):
                break
        try:
            self._preflight(adapter)
        except AdapterConfigError as error:
            raise self._refused(adapter.name, error) from None
        if self._fleet is not None:
            self._fleet.load_everywhere(adapter.name, str(self.engine_path(adapter)))
        if lineage is not None:
            with self._lock:
                names = self._lineages.setdefault(lineage, [])
                if adapter.name not in names:
                    names.append(adapter.name)
                self._lineage_of[adapter.name] = lineage
        return adapter

    def _lease(self, name: str) -> None:
        """Hold a lease on ``name``'s folder until it is unloaded or the client closes (``_adapters.lease``)."""
        if self.lora_base_dir is None or name in self._leases:
            return
        lease = hold(self.lora_base_dir, name)
        with self._lock:
            kept = self._leases.setdefault(name, lease)
        if kept is not lease:
            lease.release()  # another thread leased it meanwhile (one checkpoint resolved by path and by name)

    def release_lease(self, name: str) -> None:
        """Let go of this client's lease on ``name``'s folder (unload does; a clean-up may then delete it)."""
        with self._lock:
            lease = self._leases.pop(name, None)
        if lease is not None:
            lease.release()

    def _refused(self, name: str, error: AdapterConfigError) -> AdapterConfigError:
        """Remove the folder of an adapter the engine's model refuses (never requested, so the engine cannot hold
        it), unless another run holds a lease on it; return the error saying which."""
        from lora_sampler._adapters.lease import remove_if_unleased

        self.release_lease(name)
        assert self.lora_base_dir is not None  # publishing needs it
        try:
            removed = remove_if_unleased(self.lora_base_dir, name)
        except OSError as exc:
            why = f"; its folder {name} could not be removed from lora_base_dir ({exc})"
        else:
            kept = f"; its folder {name} is kept: another run holds a lease on it"
            why = f"; the adapter folder {name} it published was removed again" if removed else kept
        return AdapterConfigError(f"{error}{why}")

    def close(self) -> None:
        """Release every lease this client holds. Idempotent."""
        for name in list(self._leases):
            self.release_lease(name)

    def _preflight(self, adapter: Adapter) -> None:
        """Check ``adapter_config.json`` against the engine's model once per adapter, before any completion.

        Threads that meet on an adapter's first use each read its small config: nothing serialises them.
        """
        from lora_sampler._adapters.publish import check_adapter_config

        if adapter.name in self._checked or adapter.path is None:
            return
        try:
            model = self.engine_model()
        except EngineError as exc:
            # The sample's own retries deal with an unreachable engine; check again next time.
            logger.debug("Skipping the preflight of %r: %s", adapter.name, exc)
            return
        check_adapter_config(adapter.path, model)
        with self._lock:
            self._checked.add(adapter.name)

    def engine_model(self) -> str:
        """Return the engine's base model: the ``root`` of the base card in ``GET /v1/models`` (cached)."""
        return self._base_cards()[0][1]

    def loaded_adapters(self) -> Tuple[str, ...]:
        """Return the adapters the engine lists as loaded (its adapter cards in ``GET /v1/models``; not cached)."""
        return tuple(self._transport.get_json(MODELS_PATH, parse=adapter_ids))

    def served_base_models(self) -> Tuple[str, ...]:
        """Return the names the engine serves its base model under (the ids of its base cards; cached)."""
        return tuple(name for name, _, _ in self._base_cards())

    def max_model_len(self) -> Optional[int]:
        """Return the engine's context length (``max_model_len`` of its base card in ``GET /v1/models``; cached).

        None when the card does not say, or there is no base card (an engine that is not vLLM).
        """
        return next((length for _, _, length in self._base_cards(required=False) if length), None)

    def _base_cards(self, *, required: bool = True) -> List[Tuple[str, str, int]]:
        """The base cards, read once (``required``: again while none was listed, and listing none is an error).

        One thread reads them: the others that need them meanwhile (every worker meeting a new adapter's preflight)
        wait for its answer (one request's bound), not send a ``GET /v1/models`` each.
        """
        base = self._base
        if base is None or (required and not base):
            with self._reading_base:
                base = self._base
                if base is None or (required and not base):
                    base = self._transport.get_json(
                        MODELS_PATH, parse=_base_cards_of if required else _listed_base_cards
                    )
                    with self._lock:
                        self._base = base
        return base

    # -- unloading and lineages -----------------------------------------------------------------------------

    def unload(self, name: str, *, delete_files: bool = False, session_id: Optional[str] = None) -> None:
        """Unload ``name`` from the engine; then, only if the engine let go of it, delete its folder.

        The client's lease on the folder goes with the unload; with ``delete_files`` the folder is deleted only if no
        other process holds a lease on it (another run still sampling it), else it is kept and the log says so.

        Raises:
            EngineError: the engine did not confirm the unload (the files are left in place).
            FleetError: with a fleet, some replicas did not confirm (the files are left in place).
        """
        from lora_sampler._adapters.lease import remove_if_unleased

        validate_adapter_name(name, argument="adapter")
        folder = self.lora_base_dir if delete_files else None
        if delete_files and folder is None:
            raise ValueError("delete_files=True needs lora_base_dir= (the folder to delete the adapter's files from)")
        if self._fleet is not None:
            self._fleet.unload_everywhere(name)  # raises naming the replicas that did not let go
        else:
            self._unload_from_engine(name, session_id)
        # The lease goes first: a resolution recorded before it is purged below, one after it sees no lease.
        self.release_lease(name)
        with self._lock:  # in place: a resolution written meanwhile for another adapter is kept
            self._checked.discard(name)
            for key in [key for key, resolved in self._resolved.items() if resolved.name == name]:
                del self._resolved[key]
        if folder is not None and not remove_if_unleased(folder, name):
            logger.warning(
                "Kept the folder of adapter %r in %s: another run holds a lease on it (it is still sampling it)",
                name,
                folder,
            )

    def _unload_from_engine(self, name: str, session_id: Optional[str]) -> None:
        transport = self._transport
        try:
            transport.post_adapter_command(
                UNLOAD_ADAPTER_PATH, name, unload_adapter_body(name), session_id, transport.timeout
            )
        except EngineStatusError as error:
            # 404 "cannot be found" means the engine holds no such adapter; a 404 {"detail":...}
            # means runtime updating is off and the engine may still reload it from disk, so nothing is deleted.
            if not is_not_held(error.status, error.engine_message):
                error.message += "; the adapter's files were left in place"
                error.args = (error.message,)
                raise

    def request_started(self, name: str) -> None:
        """Record the start of a request for adapter ``name`` (retirement waits for requests in flight)."""
        with self._lock:
            self._in_flight[name] += 1

    def request_finished(self, name: str, *, served: bool) -> None:
        """Record the end of a request for ``name``, and retire older adapters of its lineage once due.

        An older adapter is retired once a newer one of its lineage has served a request and no request for
        the older one is in flight. Only adapters published before the newest that served are ever retired, so
        a straggler answered late for an older adapter never retires the newer one.
        """
        due: List[str] = []
        with self._lock:
            self._in_flight[name] -= 1
            lineage = self._lineage_of.get(name)
            if lineage is None:
                return
            names = self._lineages[lineage]
            if served:
                self._newest_served[lineage] = max(self._newest_served.get(lineage, 0), names.index(name))
            for older in names[: self._newest_served.get(lineage, 0)]:
                if older not in self._retired and self._in_flight[older] == 0:
                    self._retired.add(older)
                    due.append(older)
        for older in due:
            try:
                self.unload(older)  # retiring never deletes files; unload(delete_files=True) does
                logger.info("Retired adapter %r: a newer adapter of its lineage is serving", older)
            except (LoraSamplerError, OSError) as exc:
                logger.warning("Could not retire adapter %r (its files are kept): %s", older, exc)


def _key_of(spec: Union[str, PathLike]) -> str:
    """What an ``adapter=`` value is remembered by: a local checkpoint by its absolute path, else as written."""
    if is_checkpoint_path(spec) and not is_storage_url(spec):
        return os.path.abspath(os.fspath(spec))
    return str(spec)


def _listed_base_cards(body: Any) -> List[Tuple[str, str, int]]:
    """Read ``(id, root, max_model_len)`` of each base-model card (no ``parent``) from a ``GET /v1/models`` body;
    the length is 0 where the card does not say."""
    base = [
        (str(card["id"]), str(card.get("root") or card["id"]), card.get("max_model_len"))
        for card in model_cards(body)
        if not card.get("parent")
    ]
    return [(name, root, length if type(length) is int and length > 0 else 0) for name, root, length in base]


def _base_cards_of(body: Any) -> List[Tuple[str, str, int]]:
    """``_listed_base_cards``, refusing an answer that lists no base model (the engine's model is its base card)."""
    base = _listed_base_cards(body)
    if not base:
        raise ValueError("it lists no base model")
    return base
