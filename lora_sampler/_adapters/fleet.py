"""A fleet of replicas: which engines serve ``base_url``, and the adapter lifecycle on every one of them.

Replicas that never resolve adapters from disk (SGLang; vLLM without the resolver plugin; any replica that just
restarted) serve an adapter only once it was loaded on them, and a router forwards a load to one replica only. So
with ``replicas=`` the client loads, checks and unloads on each replica directly, in parallel, with its own key:

- ``load_everywhere``: ``publish`` (and publish-on-first-use): one load per replica, then its ``GET /v1/models``
  must list the adapter; any replica that cannot is named in the error.
- ``reconcile``: after a retriable adapter failure: list the replicas, load where ``/v1/models`` lacks the
  adapter. One reconciliation in flight per adapter; a thread that fails meanwhile waits for it instead. It takes
  the place of the routed proactive load: it reaches the replica that answered too (with the key the router would
  drop), and a replica never gets two loads of one adapter at once.
- ``unload_everywhere``: one unload per replica; raises naming every replica that did not confirm.

Sampling never comes here. Each of these operations talks to each replica through an ``EngineTransport`` of its
own (the one place that turns HTTP answers into values or errors), closed when it ends: they are rare (a publish, an
unload, a race), so no connection or thread is kept between them. This module only decides what to send where.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from lora_sampler._transport.exchange import normalise_base_url
from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.answers import model_cards
from lora_sampler._wire.messages import load_adapter_body, unload_adapter_body
from lora_sampler._wire.refusals import is_already_loaded, is_not_held
from lora_sampler._wire.routes import LIST_WORKERS_PATH, LOAD_ADAPTER_PATH, MODELS_PATH, UNLOAD_ADAPTER_PATH
from lora_sampler.errors import EngineError, EngineStatusError, FleetError, LoraSamplerError
from lora_sampler.retry import RetryPolicy

logger = logging.getLogger(__name__)

#: vllm-router's list of its workers: ``{"urls": ["http://10.0.0.11:8000", ...]}``.
#: The ``replicas=`` value that asks base_url (a vllm-router) for its workers.
ROUTER = "router"
#: Replicas talked to at once; a larger fleet is served in waves of this many.
MAX_PARALLEL_REPLICAS = 64

#: A fleet's replicas: ``"router"`` or replica root URLs; ``replicas=`` also takes None (one engine, no fleet).
Replicas = Union[str, Sequence[str]]
ReplicasSpec = Optional[Replicas]


def check_replicas(replicas: Replicas) -> Union[str, Tuple[str, ...]]:
    """Validate a ``replicas=`` value other than None before any request: ``"router"`` or a sequence of engine root
    URLs (None, one engine, makes no fleet).

    Raises:
        ValueError, TypeError: anything else (an empty list, a URL that is not http(s), a bare word).
    """
    if replicas == ROUTER:
        return replicas
    if isinstance(replicas, str):
        raise ValueError(
            f"replicas must be None, 'router' (base_url is a vllm-router: ask it for its workers) or a list of "
            f"replica root URLs, got the string {replicas!r}; for one replica URL, pass [{replicas!r}]"
        )
    if not isinstance(replicas, (list, tuple)):
        raise TypeError(f"replicas must be None, 'router' or a list of URLs, got {type(replicas).__name__}")
    if not replicas:
        raise ValueError("replicas is an empty list; pass at least one replica root URL, or None for base_url alone")
    return tuple(dict.fromkeys(normalise_base_url(url) for url in replicas))


class Fleet:
    """The replicas behind ``base_url`` and their adapters.

    Args:
        front: The transport to ``base_url`` (asked for ``/list_workers`` when ``replicas="router"``).
        replicas: ``"router"`` or the replica root URLs.
        retry: The client's policy: ``load_timeout`` bounds each load and unload on a replica.
        transport_options: The client's ``EngineTransport`` settings (key, timeout, TLS, answer size), for the
            transport of each replica.
    """

    def __init__(
        self, front: EngineTransport, replicas: Replicas, retry: RetryPolicy, transport_options: Dict[str, Any]
    ):
        self._front = front
        self._spec = check_replicas(replicas)  # ValueError, TypeError: before any request
        self._settings = dict(transport_options, max_workers=1)
        self._load_timeout = retry.load_timeout
        self._lock = threading.Lock()
        self._reconciling: Dict[str, threading.Event] = {}

    # -- discovery ------------------------------------------------------------------------------------------------

    def urls(self) -> Tuple[str, ...]:
        """Return the replicas' root URLs; with ``"router"``, as the router lists its workers right now.

        Raises:
            LoraSamplerError: the router's answer is not a list of workers (base_url is not a vllm-router?).
            EngineError: the router could not be reached.
        """
        if self._spec != ROUTER:
            return tuple(self._spec)
        try:
            urls = self._front.get_json(LIST_WORKERS_PATH, parse=_worker_urls)
        except EngineError as exc:
            raise LoraSamplerError(
                f"replicas='router' asks base_url for GET {LIST_WORKERS_PATH} (vllm-router's list of its workers), and "
                f"that failed: {exc}. Point base_url at a vllm-router, or pass replicas=[replica root URLs]"
            ) from None
        if not urls:
            raise LoraSamplerError(f"the router at {self._front.base_url} lists no workers ({LIST_WORKERS_PATH})")
        return tuple(dict.fromkeys(normalise_base_url(url) for url in urls))

    # -- adapter lifecycle ----------------------------------------------------------------------------------------

    def load_everywhere(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` on every replica in parallel; return once each one's ``/v1/models`` lists it.

        Each replica gets at most one load; "already been loaded" counts as loaded.

        Raises:
            FleetError: some replicas could not load it or do not list it; names each with its answer.
        """
        total, failed = self._on_every_replica(lambda replica: self._ensure(replica, name, path, check_first=False))
        if failed:
            raise _fleet_error(
                name,
                f"is not served by {len(failed)} of {total} replicas",
                failed,
                ". Check that each replica runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, sees the "
                "adapter folder at the same path, and serves the same base model (lora-sampler doctor --replicas)",
            )
        logger.info("Adapter %r is served by all %d replicas", name, total)

    def reconcile(self, name: str, path: str) -> None:
        """Load ``name`` wherever a replica's ``/v1/models`` lacks it; best-effort, never raises.

        One reconciliation runs per adapter at a time: a thread that calls while one runs waits for that one to
        end (the load it waits for is what its retry needs) instead of starting another.
        """
        with self._lock:
            running = self._reconciling.get(name)
            if running is None:
                self._reconciling[name] = threading.Event()
        if running is not None:
            running.wait(self._load_timeout * 2)
            return
        try:
            total, failed = self._on_every_replica(lambda replica: self._ensure(replica, name, path, check_first=True))
            if failed:
                logger.info(
                    "Reconciling: %s", _fleet_error(name, f"failed on {len(failed)} of {total} replicas", failed)
                )
        except (EngineError, LoraSamplerError) as exc:
            logger.info("Reconciling adapter %r failed: %s", name, exc)
        finally:
            with self._lock:
                self._reconciling.pop(name).set()

    def unload_everywhere(self, name: str) -> None:
        """Unload ``name`` from every replica in parallel.

        A replica confirmed when it answered 200, or 404 "cannot be found" (it holds no such adapter).

        Raises:
            FleetError: the replicas that did not confirm, each with its answer (the caller keeps the files).
        """
        total, failed = self._on_every_replica(lambda replica: self._unload_from(replica, name))
        if failed:
            raise _fleet_error(
                name,
                f"was not unloaded by {len(failed)} of {total} replicas",
                failed,
                "; the adapter's files were left in place. Turn runtime LoRA updating on there "
                "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or bring the replica back, then unload again",
            )

    # -- one replica ----------------------------------------------------------------------------------------------

    def _unload_from(self, replica: EngineTransport, name: str) -> str:
        """Unload ``name`` from one replica: return "" when it confirmed (it holds no such adapter now), else why."""
        try:
            self._adapter_command(replica, UNLOAD_ADAPTER_PATH, name, unload_adapter_body(name))
        except EngineStatusError as exc:
            if is_not_held(exc.status, exc.engine_message):
                return ""
            return f"unload answered HTTP {exc.status}: {exc.engine_message}"
        except EngineError as exc:
            return str(exc)
        return ""

    def _ensure(self, replica: EngineTransport, name: str, path: str, *, check_first: bool) -> str:
        """Make one replica serve ``name``: return "" when its ``/v1/models`` lists it, else what went wrong."""
        try:
            if check_first and _lists(replica, name):
                return ""
            try:
                self._adapter_command(replica, LOAD_ADAPTER_PATH, name, load_adapter_body(name, path))
            except EngineStatusError as exc:
                if not is_already_loaded(exc.engine_message):
                    return f"load answered HTTP {exc.status}: {exc.engine_message}"
            if not _lists(replica, name):
                return f"the load was accepted, but GET {MODELS_PATH} does not list the adapter"
        except EngineError as exc:  # an EngineProtocolError says what was wrong with a /v1/models answer
            return str(exc)
        return ""

    # -- the HTTP calls, and every replica in parallel ------------------------------------------------------------

    def _adapter_command(self, replica: EngineTransport, path: str, name: str, payload: Dict[str, str]) -> None:
        """POST a load or unload to one replica; an error status raises ``EngineStatusError``."""
        replica.post_adapter_command(path, name, payload, None, self._load_timeout)

    def _on_every_replica(self, task: Callable[[EngineTransport], str]) -> Tuple[int, Dict[str, str]]:
        """Run ``task`` on every replica in parallel, each through a transport of its own closed after it; return
        the number of replicas and ``{url: problem}``.

        An interrupted caller returns at once: the tasks running end within their bounds (and close their
        transports) on their own, and those not started never start.
        """
        urls = self.urls()

        def on(url: str) -> str:
            with contextlib.closing(EngineTransport(url, **self._settings)) as replica:
                return task(replica)

        pool = concurrent.futures.ThreadPoolExecutor(min(len(urls), MAX_PARALLEL_REPLICAS), "lora_sampler-fleet")
        try:
            problems = list(pool.map(on, urls))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return len(urls), {url: problem for url, problem in zip(urls, problems) if problem}


def _fleet_error(name: str, what: str, failed: Dict[str, str], advice: str = "") -> FleetError:
    """The error naming every replica in ``failed`` with its answer."""
    answers = "; ".join(f"{url}: {problem}" for url, problem in failed.items())
    return FleetError(f"adapter {name!r} {what}: {answers}{advice}", model=name, adapter=True, replicas=failed)


def _worker_urls(body: Any) -> List[str]:
    """Read vllm-router's ``{"urls": [...]}`` answer to ``GET /list_workers``."""
    urls = body.get("urls") if isinstance(body, dict) else None
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        raise ValueError("it has no 'urls' list of strings")
    return urls


def _lists(replica: EngineTransport, name: str) -> bool:
    """Whether the replica's ``GET /v1/models`` lists ``name`` as an adapter card whose ``parent`` is a base card."""
    return replica.get_json(MODELS_PATH, parse=lambda body: _lists_adapter(body, name))


def _lists_adapter(body: Any, name: str) -> bool:
    """Whether a ``GET /v1/models`` body lists ``name`` as an adapter card whose ``parent`` is a base model card."""
    cards = model_cards(body)
    bases = {card.get("id") for card in cards if not card.get("parent")}
    return any(card.get("id") == name and card.get("parent") in bases for card in cards)
