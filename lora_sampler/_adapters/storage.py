"""Checkpoints in object storage (``s3://``, ``gs://``) through fsspec: probe, list, glob, stream, settle signature.

One translation point turns whatever the storage library raises into a ``PublishError`` naming the URL and the cause,
secrets blanked. Nothing here writes to disk: ``extract`` and ``publish`` write from the streams handed out here.
"""

from __future__ import annotations

import datetime
import importlib
import io
import logging
import os
import queue
import re
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Tuple

from lora_sampler._adapters.archive import CONFIG_FILE
from lora_sampler._wire.archives import has_archive_suffix
from lora_sampler.errors import LoraSamplerError, PublishError
from lora_sampler.types import is_storage_url

__all__ = [
    "DOWNLOAD_CHUNK_SIZE",
    "StoredFile",
    "StoredObject",
    "expand",
    "is_storage_url",
    "list_folder",
    "open_object",
    "opener",
    "probe",
    "read_bytes",
    "settle_signature",
]

logger = logging.getLogger(__name__)

#: Bytes per read from the store: 1 MiB reads of one streamed GET ran at 0.8-1.2 GB/s on a loopback S3 server.
DOWNLOAD_CHUNK_SIZE = 1 << 20
#: Chunks downloaded ahead of the extraction, at most (bounds the read-ahead to 32 MiB).
READ_AHEAD_CHUNKS = 32
#: Block size of the ranged reads on stores without a streamed GET (gcsfs): few requests, bounded memory.
RANGED_BLOCK_SIZE = 16 << 20

_GLOB_CHARS = re.compile(r"[*?\[]")
# scheme -> (the fsspec implementation's package, the lora_sampler extra that installs it)
_BACKENDS: Dict[str, Tuple[str, str]] = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
# Environment variables whose values are secrets, blanked from every message like the storage options' own.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_CREDENTIALS_FIX = (
    "check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role for s3://, "
    "GOOGLE_APPLICATION_CREDENTIALS for gs://, or SamplerClient(storage_options={...})"
)


@dataclass(frozen=True)
class StoredObject:
    """What one metadata request says about a checkpoint URL.

    Attributes:
        url: The URL as given (``s3://bucket/key``).
        size: The object's size in bytes (0 for a folder).
        etag: The store's ETag, or None.
        version: The object's version (S3 ``VersionId``, GCS generation), or None.
        is_folder: The URL is a prefix (an adapter folder), not an object.
        modified: When the object was last written (seconds since the epoch), or None when the store does not say.
    """

    url: str
    size: int
    etag: Optional[str]
    version: Optional[str]
    is_folder: bool
    modified: Optional[float] = None


@dataclass(frozen=True)
class StoredFile:
    """One object of an adapter folder in storage: its path below the folder, URL, size, ETag and write time."""

    rel: str
    url: str
    size: int
    etag: Optional[str]
    modified: Optional[float] = None


def probe(url: str, options: Optional[Mapping[str, Any]] = None) -> StoredObject:
    """Ask the store about ``url`` with one metadata request (a HEAD for an object; a listing for a prefix).

    Raises:
        PublishError: the extra is not installed, or the object/bucket is missing, access is denied, the store is
            unreachable.
    """
    fs, path = _filesystem(url, options)
    with translated(url, options, "look up"):
        fs.invalidate_cache(path)  # a cached listing would hide a rewritten object
        info = fs.info(path)
    if info.get("type") == "directory":
        return StoredObject(url, 0, None, None, True)
    etag = info.get("ETag") or info.get("etag")
    version = info.get("VersionId") or info.get("generation")
    return StoredObject(url, int(info.get("size") or 0), _text(etag), _text(version), False, _modified(info))


def list_folder(url: str, options: Optional[Mapping[str, Any]] = None) -> List[StoredFile]:
    """List every object below the prefix ``url`` (recursively), sorted by path below it.

    Zero-byte ``folder/`` placeholder objects that consoles create are skipped.
    """
    fs, path = _filesystem(url, options)
    root = path.rstrip("/")
    with translated(url, options, "list"):
        fs.invalidate_cache(root)
        found = fs.find(root, detail=True)
    files = []
    for name, info in found.items():
        rel = name[len(root) :].lstrip("/")
        if not rel or name.endswith("/") or info.get("type") == "directory":
            continue
        etag = _text(info.get("ETag") or info.get("etag"))
        files.append(StoredFile(rel, _join(url, rel), int(info.get("size") or 0), etag, _modified(info)))
    return sorted(files, key=lambda file: file.rel)


def expand(pattern: str, options: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Return the checkpoints a storage URL or glob names now: archive objects and prefixes, in the store's order.

    A URL without glob characters that names nothing (yet) gives an empty list, so a watch can wait for it.
    """
    fs, path = _filesystem(pattern, options)
    scheme = pattern.split("://", 1)[0]
    with translated(pattern, options, "list"):
        fs.invalidate_cache()
        if not _GLOB_CHARS.search(path):
            return [pattern] if fs.exists(path) else []
        matches = fs.glob(path, detail=True)
    return [
        f"{scheme}://{name}"
        for name, info in matches.items()
        if info.get("type") == "directory" or has_archive_suffix(name)
    ]


def settle_signature(url: str, options: Optional[Mapping[str, Any]] = None) -> Tuple[float, Optional[str], Any]:
    """Return ``(newest write time, problem, signature)`` of a stored checkpoint, for a sweep's settle rule.

    An object is written whole (a store never shows half an upload), so it has no problem; its signature is its
    ETag, version and size. A prefix's signature is its objects' paths, ETags and sizes; until one of them is
    ``adapter_config.json`` it is not complete. One request for an object, a listing for a prefix.

    Raises:
        FileNotFoundError: nothing is at ``url`` (yet).
        PublishError: the store refused or could not be reached.
    """
    with _absent_as_not_found(url):
        stored = probe(url, options)
        files = list_folder(url, options) if stored.is_folder else []
    if not stored.is_folder:
        return (stored.modified or 0.0, None, ("object", stored.etag, stored.version, stored.size))
    newest = max((f.modified or 0.0 for f in files), default=0.0)
    has_config = any(f.rel.split("/")[-1] == CONFIG_FILE and f.rel.count("/") <= 1 for f in files)
    problem = None if has_config else f"its {CONFIG_FILE} is not in the store yet"
    return (newest, problem, ("prefix", tuple((f.rel, f.etag, f.size) for f in files)))


def read_bytes(url: str, options: Optional[Mapping[str, Any]] = None) -> bytes:
    """Return a small object's bytes (a training run's manifest) from one GET.

    Raises:
        FileNotFoundError: there is no such object (yet).
        PublishError: the store refused or could not be reached.
    """
    fs, path = _filesystem(url, options)
    with _absent_as_not_found(url), translated(url, options, "read"):
        fs.invalidate_cache(path)
        return bytes(fs.cat_file(path))


@contextmanager
def _absent_as_not_found(url: str) -> Iterator[None]:
    """Raise a missing object as ``FileNotFoundError`` (a watch waits for it), every other failure unchanged."""
    try:
        yield
    except PublishError as error:
        if isinstance(error.__cause__, FileNotFoundError):
            raise FileNotFoundError(url) from error
        raise


def opener(file: StoredFile, options: Optional[Mapping[str, Any]] = None) -> Callable[[], ContextManager[io.RawIOBase]]:
    """Return a callable opening one file of a stored folder with ``open_object`` (for ``extract.copy_files``)."""
    return partial(open_object, StoredObject(file.url, file.size, file.etag, None, False), options)


@contextmanager
def open_object(
    stored: StoredObject, options: Optional[Mapping[str, Any]] = None, *, expected_size: Optional[int] = None
) -> Iterator[io.RawIOBase]:
    """Open one object as a raw stream, downloaded ahead of the reader by a thread of its own.

    On S3 the object is one GET (``If-Match`` its probed ETag, so a rewrite mid-way fails instead of mixing two
    versions) read in ``DOWNLOAD_CHUNK_SIZE`` steps; elsewhere it is fsspec's ranged file. While the caller
    decompresses and writes one chunk, the next ones arrive: the download overlaps the extraction.

    Raises:
        PublishError: (on a read) the connection dropped, the object changed, or it ended short of its size.
    """
    fs, path = _filesystem(stored.url, options)
    size = stored.size if expected_size is None else expected_size
    with translated(stored.url, options, "download"):
        chunks = _s3_chunks(fs, path, stored) if _is_s3(fs) else _ranged_chunks(fs, path)
        reader = _ReadAhead(chunks, stored.url, size, options)
    try:
        yield reader
    finally:
        reader.close()


def _s3_chunks(fs: Any, path: str, stored: StoredObject) -> Iterator[bytes]:
    """Yield the object's bytes from one streamed S3 GET (s3fs's client and credentials, not a second stack)."""
    from fsspec.asyn import sync

    bucket, key, version = fs.split_path(path)
    request: Dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version or stored.version:
        request["VersionId"] = version or stored.version
    elif stored.etag:
        request["IfMatch"] = stored.etag
    body = fs.call_s3("get_object", **request)["Body"]
    try:
        while True:
            chunk = sync(fs.loop, _read_up_to, body, DOWNLOAD_CHUNK_SIZE)
            if not chunk:
                return
            yield chunk
    finally:
        body.close()


async def _read_up_to(body: Any, size: int) -> bytes:
    """Read ``size`` bytes (fewer only at the end) in the event loop: one thread hand-off per chunk, not per piece.

    The response body hands out what the socket has (typically 512 KiB pieces); gathering a whole chunk inside the
    loop halves the hand-offs between the loop's thread and the download thread.
    """
    parts: List[bytes] = []
    received = 0
    while received < size:
        part = await body.read(size - received)
        if not part:
            break
        parts.append(part)
        received += len(part)
    return b"".join(parts)


def _ranged_chunks(fs: Any, path: str) -> Iterator[bytes]:
    with fs.open(path, "rb", block_size=RANGED_BLOCK_SIZE, cache_type="readahead") as file:
        while True:
            chunk = file.read(DOWNLOAD_CHUNK_SIZE)
            if not chunk:
                return
            yield chunk


class _ReadAhead(io.RawIOBase):
    """A raw reader over chunks that a thread downloads up to ``READ_AHEAD_CHUNKS`` ahead of the caller.

    A download error is raised to the reader as a ``PublishError``; so is an object that ends before its size.
    ``close`` stops the thread and releases the connection, also when the reader stops early.
    """

    def __init__(self, chunks: Iterator[bytes], url: str, size: int, options: Optional[Mapping[str, Any]]) -> None:
        super().__init__()
        self._chunks = chunks
        self._url = url
        self._size = size
        self._options = options
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self._stop = threading.Event()
        self._pending = memoryview(b"")
        self._received = 0
        self._done = False
        self._thread = threading.Thread(target=self._download, name="lora_sampler-download", daemon=True)
        self._thread.start()

    def readable(self) -> bool:
        return True

    def _download(self) -> None:
        try:
            for chunk in self._chunks:
                if not self._put(chunk):
                    return
            self._put(None)
        except BaseException as error:  # handed to the reader, which raises it as a PublishError
            self._put(error)
        finally:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def readinto(self, buffer: Any) -> int:
        while not self._pending and not self._done:
            item = self._queue.get()
            if item is None:
                self._done = True
                if self._received != self._size:
                    raise PublishError(
                        f"cannot download {self._url}: the object ended after {self._received} of its {self._size} "
                        "bytes (it changed, or the connection dropped); nothing was published. Publish it again"
                    )
            elif isinstance(item, BaseException):
                self._done = True
                raise _translate(item, self._url, self._options, "download") from item
            else:
                self._pending = memoryview(item)
                self._received += len(item)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with suppress(queue.Empty):
                self._queue.get(timeout=0.05)  # unblock a put
        super().close()


@contextmanager
def translated(url: str, options: Optional[Mapping[str, Any]], action: str) -> Iterator[None]:
    """Turn whatever the storage library raises inside the block into a ``PublishError`` naming URL and cause."""
    try:
        yield
    except LoraSamplerError:
        raise
    except Exception as error:
        raise _translate(error, url, options, action) from error


def _translate(error: BaseException, url: str, options: Optional[Mapping[str, Any]], action: str) -> PublishError:
    if isinstance(error, LoraSamplerError):
        return PublishError(error.message)
    cause = _redacted(f"{type(error).__name__}: {error}", options)
    if isinstance(error, FileNotFoundError):
        message = f"cannot {action} {url}: no such object, prefix or bucket ({cause}); check the URL"
    elif isinstance(error, PermissionError):
        message = f"cannot {action} {url}: access denied ({cause}); {_CREDENTIALS_FIX}"
    else:
        message = (
            f"cannot {action} {url}: {cause}; nothing was published. Check that the store is reachable "
            "(AWS_ENDPOINT_URL or storage_options={'endpoint_url': ...} for an S3-compatible store), then try again"
        )
    return PublishError(message)


def _redacted(text: str, options: Optional[Mapping[str, Any]]) -> str:
    """Blank every secret-looking value of the options and the environment out of ``text``."""
    secrets = [os.environ.get(name) for name in _SECRET_ENV]
    secrets += [str(value) for key, value in _flat_items(options or {}) if _is_secret_key(key)]
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _flat_items(options: Mapping[str, Any]) -> Iterator[Tuple[str, Any]]:
    for key, value in options.items():
        if isinstance(value, Mapping):
            yield from _flat_items(value)
        else:
            yield str(key), value


def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(word in lowered for word in ("secret", "token", "password", "key", "credential"))


def _filesystem(url: str, options: Optional[Mapping[str, Any]]) -> Tuple[Any, str]:
    """Return the fsspec filesystem for ``url``'s scheme (cached by fsspec per options) and the URL's path.

    Raises:
        PublishError: the URL's extra is not installed (naming it), or the options are refused.
    """
    scheme = url.split("://", 1)[0].lower() if is_storage_url(url) else ""
    if scheme not in _BACKENDS:
        raise PublishError(f"{url!r} is not a storage URL; use one of {', '.join(s + '://' for s in _BACKENDS)}")
    package, extra = _BACKENDS[scheme]
    try:
        fsspec = importlib.import_module("fsspec")
        importlib.import_module(package)
    except ImportError as error:
        raise PublishError(
            f"cannot read {url}: {scheme}:// checkpoints need the optional extra lora_sampler[{extra}] "
            f"({error.name or package} is not installed); install it: pip install 'lora_sampler[{extra}]'"
        ) from None
    with translated(url, options, "open a storage client for"):
        fs = fsspec.filesystem(scheme, **dict(options or {}))
    return fs, fs._strip_protocol(url)


def _is_s3(fs: Any) -> bool:
    return "s3" in getattr(fs, "protocol", ())


def _join(url: str, rel: str) -> str:
    return url.rstrip("/") + "/" + rel


def _text(value: Any) -> Optional[str]:
    return None if value is None else str(value)


def _modified(info: Mapping[str, Any]) -> Optional[float]:
    """Read an object's write time from s3fs (``LastModified``, a datetime) or gcsfs (``updated``, ISO text)."""
    value = info.get("LastModified") or info.get("updated") or info.get("mtime")
    if isinstance(value, str):
        with suppress(ValueError):
            value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return float(value) if isinstance(value, (int, float)) else None
