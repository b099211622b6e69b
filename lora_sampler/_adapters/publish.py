"""Checkpoint to published adapter folder, one straight pipeline: read, check each member, extract, rename.

``publish_checkpoint`` first reads the checkpoint's signature, never its content (a local file's size, times and
inode; a stored object's ETag, version and size, one metadata request), and returns at once the folder an earlier
publish of that very signature left (its ``.lora_sampler.json`` records it, so a new process finds it too). Else it
fills a hidden temporary folder inside ``lora_base_dir`` (an archive extracted member by member, each checked,
hashed in the same pass; a folder's adapter files copied), checks its ``adapter_config.json`` and renames it into
place. The published folders are the only record: nothing is cached in the process. Threads of one process
publishing one checkpoint take turns (the first reads it, the others find its folder); between processes a lost
rename (``EEXIST``/``ENOTEMPTY``) just means another publisher won. The engine's filesystem resolver loads
``<lora_base_dir>/<name>`` lazily, so a folder must appear there complete or not at all. No HTTP and no threads
here; the client reads the engine's model and calls ``check_adapter_config`` itself.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from lora_sampler._adapters import storage
from lora_sampler._adapters.archive import (
    CONFIG_FILE,
    MARKER_FILE,
    Chunks,
    StrPath,
    checkpoint_digest,
    clean_stale_temporaries,
    file_chunks,
    file_signature,
    fsync_folders,
    list_folder_files,
    make_temp_folder,
)
from lora_sampler._adapters.extract import (
    DEFAULT_LIMITS,
    PublishLimits,
    copy_files,
    extract_archive,
)
from lora_sampler._files import replacing
from lora_sampler._locks import KeyedLocks
from lora_sampler._wire.archives import strip_archive_suffix
from lora_sampler.errors import AdapterConfigError, PublishError
from lora_sampler.names import validate_adapter_name
from lora_sampler.types import Adapter, is_storage_url

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_DIGEST_CHARS",
    "DEFAULT_DURABLE",
    "DEFAULT_STEM_LENGTH",
    "LM_HEAD_NOTE",
    "MAX_CONFIG_BYTES",
    "adapter_targets_lm_head",
    "check_adapter_config",
    "check_config_content",
    "check_local_checkpoint",
    "default_adapter_name",
    "missing_config",
    "publish_checkpoint",
    "read_config",
    "read_published_digest",
    "remove_adapter_dir",
    "targets_lm_head",
]

logger = logging.getLogger(__name__)

#: Longest readable part of a default name, before ``-<digest>``.
DEFAULT_STEM_LENGTH = 64
#: Hex digits of the sha256 that end a default name.
DEFAULT_DIGEST_CHARS = 12
#: fsync every file and folder before the rename, so a host crash cannot publish empty files (cost: see benchmarks).
DEFAULT_DURABLE = True

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
#: One publish of a checkpoint into a folder at a time per process: a download or extraction is never done twice
#: at once (between processes the rename decides, and the loser's work is thrown away).
_publishing = KeyedLocks()


def default_adapter_name(checkpoint: StrPath, digest: Optional[str] = None) -> str:
    """Return the content-derived name of a checkpoint: ``<readable stem>-<12 hex of its sha256>``.

    Changed weights give a new name, so the engine never serves a stale cached adapter under an old one. The stem
    is the file name made to follow the adapter-name rule (``names.NAME_RULE``), and the result is checked by that
    same rule.

    Args:
        checkpoint: An archive or adapter folder.
        digest: Its ``checkpoint_digest``, if already known (else the checkpoint is read and hashed).
    """
    path = os.path.abspath(os.fspath(checkpoint))
    return _named(_name_stem(path, os.path.isdir(path)), digest or checkpoint_digest(path))


def _name_stem(path: str, is_folder: bool) -> str:
    """The readable part of a default name: the file name without its archive suffix, in the rule's characters."""
    stem = os.path.basename(path.rstrip("/"))  # a path's or a URL's last segment
    if not is_folder:
        stem = strip_archive_suffix(stem)
    stem = re.sub(r"\.{2,}", ".", _UNSAFE_NAME_CHARS.sub("-", stem))
    return stem.lstrip(".-")[:DEFAULT_STEM_LENGTH].rstrip(".-") or "adapter"


def _named(stem: str, digest: str) -> str:
    return validate_adapter_name(f"{stem}-{digest[:DEFAULT_DIGEST_CHARS]}")


@dataclass(frozen=True)
class _Checkpoint:
    """What is known of a checkpoint before its content is read.

    Attributes:
        where: Its absolute path or URL (what the published folder records as its source).
        stem: The readable part of its default name.
        signature: What changes when its content may have (JSON: recorded in the published folder's marker).
        archive: The archive's bytes (a local file, or a stored object streamed), read if it is published anew;
            None for a folder.
        files: A folder's files, ``(relative path, size, chunks)``; empty for an archive.
    """

    where: str
    stem: str
    signature: List[Any]
    archive: Optional[Chunks] = None
    files: Sequence[Tuple[str, int, Chunks]] = ()

    @property
    def stored(self) -> bool:
        """It is in a store (``where`` is its URL): a store's object is written whole, so it is not signed again
        after it was read, and it is never a folder already in place."""
        return is_storage_url(self.where)


def publish_checkpoint(
    checkpoint: StrPath,
    lora_base_dir: StrPath,
    *,
    name: Optional[str] = None,
    limits: PublishLimits = DEFAULT_LIMITS,
    storage_options: Optional[Mapping[str, Any]] = None,
) -> Adapter:
    """Publish a checkpoint as ``<lora_base_dir>/<name>``, complete or not at all.

    The checkpoint is extracted (or copied) into a dotted temporary folder inside ``lora_base_dir`` (same
    filesystem; the resolver never takes a dotted name for an adapter), checked, fsynced, and moved into place with
    one ``os.rename``. Any number of threads and processes publishing the same checkpoint all succeed and leave one
    folder: a rename failing with ``EEXIST``/``ENOTEMPTY`` means another publisher won, and its digest is verified.
    A checkpoint whose signature (a file's size, times and inode; a stored object's ETag or version and size) a
    published folder records is returned at once, without reading it: in a new process too. Otherwise an archive is
    read once, hashed while it is extracted, its compressed stream verified to the end; a storage URL's object is
    streamed through the same pass (no local copy).

    Args:
        checkpoint: A ``.tar.gz``/``.tgz``/``.tar`` (or bzip2/xz) archive of an adapter folder (files at its root
            or inside one top-level folder), or the adapter folder itself; either may be a storage URL
            (``s3://bucket/key``, ``gs://bucket/prefix/``).
        lora_base_dir: The engine resolver's folder (``VLLM_LORA_RESOLVER_CACHE_DIR``) as this machine sees it.
        name: The adapter name; default ``default_adapter_name(checkpoint)``.
        limits: Bounds on the extracted size, the member count and the member name length (``PublishLimits``).
        storage_options: Options of the storage library (fsspec's s3fs/gcsfs) for a storage URL; None uses its
            standard chain (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles, roles).

    Returns:
        The published ``Adapter`` (name, folder, sha256 digest of the checkpoint, checkpoint path).

    Raises:
        PublishError: the checkpoint or ``lora_base_dir`` is missing or unreadable, the archive is corrupted or
            truncated, the disk is full, or ``name`` already holds other content (the message names both digests).
            Nothing is published and no temporary folder is left.
        UnsafeArchiveError: an archive member is hostile (absolute, ``..``, link, device, FIFO) or the checkpoint
            exceeds one of ``limits``.
        AdapterConfigError: ``adapter_config.json`` is missing, invalid JSON, or not a LoRA.
        ValueError: ``name`` is not a valid adapter name.
    """
    base = _checked_arguments(lora_base_dir, name, limits)
    stored = is_storage_url(checkpoint)
    where = str(checkpoint) if stored else os.path.abspath(os.fspath(checkpoint))
    with _publishing.hold((base, where)):  # threads of this process: the first reads it, the others find its folder
        read = _stored_checkpoint(where, storage_options) if stored else _local_checkpoint(where)
        return _published_before(base, name, read) or _publish_new(base, name, read, limits)


def _checked_arguments(lora_base_dir: StrPath, name: Optional[str], limits: PublishLimits) -> str:
    """Check the name, the limits and the resolver folder before any file is read; return the folder's path."""
    if name is not None:
        validate_adapter_name(name)
    if not isinstance(limits, PublishLimits):
        raise TypeError(f"limits must be a PublishLimits, got {type(limits).__name__}")
    base = os.path.abspath(os.fspath(lora_base_dir))
    if not os.path.isdir(base):
        raise PublishError(
            f"lora_base_dir {base} is not a folder; create it, or pass the engine's VLLM_LORA_RESOLVER_CACHE_DIR "
            "as this machine sees it"
        )
    return base


# -- read: a checkpoint's signature, and how to fill a folder with it -------------------------------------------


def _local_checkpoint(source: str) -> _Checkpoint:
    """A local archive (signed by its stat) or folder (by its files' stats)."""
    check_local_checkpoint(source)
    signature = _local_signature(source)  # before the files are listed: a file added after it is a change
    if not os.path.isdir(source):
        return _Checkpoint(source, _name_stem(source, False), signature, archive=file_chunks(source))
    files = [(rel, os.path.getsize(full), file_chunks(full)) for rel, full in list_folder_files(source)]
    return _Checkpoint(source, _name_stem(source, True), signature, files=files)


def check_local_checkpoint(source: str) -> None:
    """Refuse a local checkpoint path that publishing cannot read: absent, or neither a folder nor a regular file (a
    pipe would be waited on for ever), before anything is opened.

    Raises:
        PublishError: naming the path and what to pass instead.
    """
    if not os.path.exists(source):
        raise PublishError(f"checkpoint {source} does not exist; pass an adapter archive or folder")
    if not os.path.isdir(source) and not os.path.isfile(source):
        raise PublishError(f"checkpoint {source} is not a regular file (device, FIFO or socket); pass the archive")


def _local_signature(source: str) -> List[Any]:
    if os.path.isdir(source):
        return [[rel, *file_signature(full)] for rel, full in list_folder_files(source)]
    return list(file_signature(source))


def _stored_checkpoint(url: str, options: Optional[Mapping[str, Any]]) -> _Checkpoint:
    """A storage URL: an object (signed by its ETag, version and size) or a prefix (by its listing); one request for
    an archive or a prefix (``look_up``)."""
    stored, listed = storage.look_up(url, options)
    if not stored.is_folder:
        chunks = storage.open_object(stored, options)
        return _Checkpoint(url, _name_stem(url, False), [stored.etag, stored.version, stored.size], chunks)
    found = [f for f in listed if f.rel != MARKER_FILE]
    if not found:
        raise PublishError(f"cannot publish {url}: the prefix holds no files; pass an adapter folder or archive URL")
    files = [(f.rel, f.size, storage.open_object(f, options)) for f in found]
    signature: List[Any] = [[f.rel, f.etag, f.size] for f in found]
    source = url.rstrip("/")  # prefix and prefix/ are one checkpoint
    return _Checkpoint(source, _name_stem(url, True), signature, files=files)


def _fill(checkpoint: _Checkpoint, temp: str, limits: PublishLimits) -> str:
    """Extract the archive (one pass, hashed as it is read) or copy the folder's files into ``temp``; return the
    checkpoint's digest (a folder's: that of the adapter folder it holds, at its root or in its one top-level folder,
    as a store's prefix may). A local checkpoint whose signature changed meanwhile is refused (it may mix two
    versions)."""
    if checkpoint.archive is not None:
        digest = extract_archive(
            checkpoint.where, temp, limits=limits, durable=DEFAULT_DURABLE, chunks=checkpoint.archive
        )
    else:
        copy_files(checkpoint.where, checkpoint.files, temp, limits=limits, durable=DEFAULT_DURABLE)
        digest = checkpoint_digest(_adapter_root(temp, checkpoint.where))
    if not checkpoint.stored and _local_signature(checkpoint.where) != checkpoint.signature:
        raise PublishError(f"checkpoint {checkpoint.where} changed while it was being published; publish it again")
    return digest


# -- published before? else extract and rename ------------------------------------------------------------------


def _published_before(base: str, name: Optional[str], checkpoint: _Checkpoint) -> Optional[Adapter]:
    """Return the folder whose marker records this very checkpoint (source and signature), if there is one; or the
    checkpoint folder itself when it already is ``<base>/<name>`` (hashed, not copied)."""
    if name is not None and _is_in_place(base, name, checkpoint):
        folder = os.path.join(base, name)
        return Adapter(name=name, path=folder, digest=checkpoint_digest(folder), source=checkpoint.where)
    default = re.compile(re.escape(checkpoint.stem) + f"-[0-9a-f]{{{DEFAULT_DIGEST_CHARS}}}")
    entries = [name] if name is not None else [entry for entry in os.listdir(base) if default.fullmatch(entry)]
    recorded = {"source": checkpoint.where, "stored": checkpoint.signature}
    for entry in entries:
        marker = read_marker(os.path.join(base, entry))
        if {key: marker.get(key) for key in recorded} == recorded and isinstance(marker.get("digest"), str):
            return Adapter(name=entry, path=os.path.join(base, entry), digest=marker["digest"], source=checkpoint.where)
    return None


def _is_in_place(base: str, name: str, checkpoint: _Checkpoint) -> bool:
    """Whether the checkpoint is a local folder that already is ``<base>/<name>``."""
    return not checkpoint.stored and os.path.realpath(os.path.join(base, name)) == os.path.realpath(checkpoint.where)


def _publish_new(base: str, name: Optional[str], checkpoint: _Checkpoint, limits: PublishLimits) -> Adapter:
    """Fill a temporary folder (``_fill`` returns the digest), check it, and rename it into place.

    The temporary folder never outlives the call, whatever ``_fill`` raises.
    """
    clean_stale_temporaries(base)
    temp = make_temp_folder(base, "tmp", name or checkpoint.stem)
    try:
        digest = _fill(checkpoint, temp, limits)
        name = name or _named(checkpoint.stem, digest)
        target = os.path.join(base, name)
        existing = _published_adapter(base, name, digest, checkpoint)
        if existing is None:
            return _rename_into_place(temp, checkpoint, base, target, name, digest)
        recorded = read_marker(target)
        if recorded.get("source") == checkpoint.where and recorded.get("stored") != checkpoint.signature:
            _write_marker(target, digest, checkpoint.where, checkpoint.signature)  # touched, or re-saved the same
        return existing
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _rename_into_place(temp: str, checkpoint: _Checkpoint, base: str, target: str, name: str, digest: str) -> Adapter:
    source = checkpoint.where
    root = _adapter_root(temp, source)
    if targets_lm_head(check_adapter_config(root, None)):
        logger.warning("%s: %s", source, LM_HEAD_NOTE)
    _write_marker(root, digest, source, checkpoint.signature)
    try:
        os.rename(root, target)
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        winner = _published_adapter(base, name, digest, checkpoint)
        if winner is None:  # pragma: no cover - the winner vanished between rename and look-up
            raise PublishError(f"could not publish {source} as {target}: {error}; try again") from error
        logger.debug("another publisher of %s won the rename to %s", source, target)
        return winner
    if DEFAULT_DURABLE:
        fsync_folders([base])
    logger.info("published %s as %s", source, target)
    return Adapter(name=name, path=target, digest=digest, source=source)


def _published_adapter(base: str, name: str, digest: str, checkpoint: _Checkpoint) -> Optional[Adapter]:
    """Return the adapter already at ``<base>/<name>`` if it holds ``digest``, None if nothing is there; else raise."""
    target, source = os.path.join(base, name), checkpoint.where
    if not os.path.lexists(target):
        return None
    adapter = Adapter(name=name, path=target, digest=digest, source=source)
    if _is_in_place(base, name, checkpoint):
        return adapter  # the checkpoint folder is already in place under this name
    published = read_published_digest(target)
    if published == digest:
        return adapter
    raise PublishError(
        f"adapter name {name!r} already holds different content in {target}: its digest is "
        f"{published or f'unknown (no {MARKER_FILE}; not published by lora_sampler)'}, the checkpoint {source} has "
        f"digest {digest}. Pass another name (or none, for a content-derived one); to replace it, unload it from "
        "the engine first, then remove_adapter_dir (rewriting a folder the engine may reload kills the engine)"
    )


def read_published_digest(adapter_dir: StrPath) -> Optional[str]:
    """Return the checkpoint digest recorded in a folder published by lora_sampler, or None."""
    digest = read_marker(adapter_dir).get("digest")
    return digest if isinstance(digest, str) else None


def read_marker(adapter_dir: StrPath) -> Dict[str, Any]:
    """Return the marker publish wrote into an adapter folder (digest, source, ...); {} when there is none."""
    try:
        with open(os.path.join(os.fspath(adapter_dir), MARKER_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_marker(root: str, digest: str, source: str, stored: List[Any]) -> None:
    """Record the digest, the source and its signature (``stored``) in ``root``, replacing any record whole."""
    record = {"digest": digest, "algorithm": "sha256", "source": source, "published_by": "lora_sampler"}
    with replacing(os.path.join(root, MARKER_FILE), durable=DEFAULT_DURABLE) as out:  # old or new, never half
        out.write(json.dumps({**record, "stored": stored}).encode("utf-8"))
    if DEFAULT_DURABLE:
        fsync_folders([root])


def _adapter_root(temp: str, source: str) -> str:
    """Return the extracted folder holding ``adapter_config.json``: the root, or its single top-level folder."""
    if os.path.isfile(os.path.join(temp, CONFIG_FILE)):
        return temp
    entries = sorted(os.listdir(temp))
    if len(entries) == 1 and os.path.isfile(os.path.join(temp, entries[0], CONFIG_FILE)):
        return os.path.join(temp, entries[0])
    raise missing_config(source, entries)


def missing_config(source: str, entries: Sequence[str]) -> AdapterConfigError:
    """The error for a checkpoint whose top-level ``entries`` (sorted) hold no config where publishing looks."""
    return AdapterConfigError(
        f"{source} has no {CONFIG_FILE} at its root or inside a single top-level folder (found: {list(entries[:10])}); "
        "pass the folder written by peft's save_pretrained, or an archive of it"
    )


def remove_adapter_dir(lora_base_dir: StrPath, name: str) -> bool:
    """Delete a published adapter folder without the engine ever seeing it half-deleted.

    The folder is first renamed to a dotted temporary name (one atomic step), then removed. Unload the adapter
    from the engine first: deleting a folder the engine may reload from disk kills the engine (vLLM reloads an
    evicted adapter from its folder). A symlink under ``name`` is unlinked, never followed.

    Returns:
        True if something was removed, False if nothing was there.

    Raises:
        ValueError: ``name`` is not a valid adapter name (e.g. it would escape ``lora_base_dir``).
    """
    validate_adapter_name(name)  # one path component: no separator, no "..", no leading dot
    base = os.path.abspath(os.fspath(lora_base_dir))
    target = os.path.join(base, name)
    if os.path.islink(target) or os.path.isfile(target):
        os.unlink(target)
        return True
    if not os.path.isdir(target):
        return False
    doomed = make_temp_folder(base, "del", name)
    try:
        os.rename(target, os.path.join(doomed, name))
    except FileNotFoundError:  # another remover was first
        os.rmdir(doomed)
        return False
    shutil.rmtree(doomed)
    logger.info("removed adapter folder %s", target)
    return True


#: The output layer's module name in peft's ``target_modules`` (Llama, Mistral, Qwen and most causal LMs).
LM_HEAD_MODULE = "lm_head"
#: What scoring says of an adapter that targets ``lm_head`` (the output, the summary, ``CheckpointReport.notes``).
LM_HEAD_NOTE = (
    "the adapter targets lm_head, and some engines leave lm_head's LoRA delta out of prompt logprobs (vLLM issue "
    "#51594) while generation logprobs keep it: check this engine with 'lora-sampler doctor --adapter CKPT --scoring'"
)


def targets_lm_head(config: Mapping[str, Any]) -> bool:
    """Tell whether an adapter config's ``target_modules`` names the output layer (a list entry, or a peft regex).

    peft's ``"all-linear"`` leaves the output layer out, so it does not count.
    """
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            return False
        try:
            return re.fullmatch(targets, LM_HEAD_MODULE) is not None
        except re.error:
            return False
    if isinstance(targets, (list, tuple)):
        return any(isinstance(t, str) and (t == LM_HEAD_MODULE or t.endswith("." + LM_HEAD_MODULE)) for t in targets)
    return False


def adapter_targets_lm_head(adapter_dir: Optional[StrPath]) -> bool:
    """Tell whether the adapter folder's ``adapter_config.json`` targets ``lm_head`` (False when it is not a config
    ``check_adapter_config`` accepts: unreadable, or not a LoRA vLLM serves)."""
    try:
        return adapter_dir is not None and targets_lm_head(check_adapter_config(adapter_dir, None))
    except AdapterConfigError:
        return False


def check_adapter_config(adapter_dir: StrPath, engine_model: Optional[str]) -> Dict[str, Any]:
    """Check an adapter folder's ``adapter_config.json`` before any request is sent, and return it.

    vLLM's resolver loads a folder only if ``peft_type`` is ``"LORA"`` and ``base_model_name_or_path`` equals the
    engine's ``--model`` string exactly; otherwise every request gets a permanent 404.

    Args:
        adapter_dir: The adapter folder.
        engine_model: The engine's model as read from ``GET /v1/models``; None skips the base-model check.

    Raises:
        AdapterConfigError: naming the file, the values found and expected, and the fix.
    """
    path = os.path.join(os.fspath(adapter_dir), CONFIG_FILE)
    try:
        with closing(file_chunks(path)) as chunks:
            content = read_config(chunks, path)
    except FileNotFoundError:
        raise AdapterConfigError(
            f"{path} is missing; an adapter folder needs the {CONFIG_FILE} written by peft's save_pretrained"
        ) from None
    except OSError as error:
        raise _unreadable(path, error) from error
    return check_config_content(content, path, engine_model)


#: Largest ``adapter_config.json`` read, in bytes: peft writes a few KiB, so a larger file is not an adapter's config,
#: and it is refused before it is read whole.
MAX_CONFIG_BYTES = 1 << 20


def read_config(chunks: Iterable[bytes], path: str) -> bytes:
    """Read an ``adapter_config.json``'s bytes (a folder's file, an archive member's data) up to ``MAX_CONFIG_BYTES``.

    Raises:
        AdapterConfigError: the file holds more, naming ``path`` and the bound.
    """
    content = bytearray()
    for chunk in chunks:
        content += chunk
        if len(content) > MAX_CONFIG_BYTES:
            raise AdapterConfigError(
                f"{path} holds more than MAX_CONFIG_BYTES={MAX_CONFIG_BYTES} bytes, and peft writes a config of a few "
                "KiB; re-save the adapter with peft's save_pretrained"
            )
    return bytes(content)


def _unreadable(path: str, error: Exception) -> AdapterConfigError:
    """The error for an ``adapter_config.json`` that cannot be read or parsed (either way, re-saving mends it)."""
    return AdapterConfigError(f"{path} is not readable JSON ({error}); re-save the adapter with peft's save_pretrained")


def check_config_content(content: bytes, path: str, engine_model: Optional[str]) -> Dict[str, Any]:
    """Check the content of an ``adapter_config.json`` read elsewhere (a folder's file, an archive's member), and
    return it parsed: the rules of ``check_adapter_config``, in messages that name the file as ``path``.

    Raises:
        AdapterConfigError: naming ``path``, the values found and expected, and the fix.
    """
    try:
        config = json.loads(content.decode("utf-8"))  # a decode error is unreadable JSON too
    except ValueError as error:
        raise _unreadable(path, error) from error
    if not isinstance(config, dict):
        raise AdapterConfigError(f"{path} holds a {type(config).__name__}, not a JSON object; re-save the adapter")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterConfigError(
            f"{path} has peft_type={peft_type!r}, but vLLM serves only peft_type='LORA'; re-save the adapter as a "
            "LoRA (peft.LoraConfig)"
        )
    saved = config.get("modules_to_save")
    if saved:
        raise AdapterConfigError(
            f"{path} has modules_to_save={saved!r}: the adapter carries whole trained modules besides its LoRA deltas, "
            "and vLLM refuses to load such adapters (it serves LoRA deltas only); train without modules_to_save, or "
            "set it to null in adapter_config.json if serving without those modules is what you want"
        )
    base_model = config.get("base_model_name_or_path")
    if engine_model is not None and base_model != engine_model:
        raise AdapterConfigError(
            f"{path} has base_model_name_or_path={base_model!r}, but the engine serves {engine_model!r}, and vLLM "
            "compares the exact string (a mismatch answers every request with 404); re-save the adapter with "
            f"base_model_name_or_path={engine_model!r}, or set that field in {CONFIG_FILE} before publishing"
        )
    return config
