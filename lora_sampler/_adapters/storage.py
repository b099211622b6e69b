"""Checkpoints in object storage (``s3://``, ``gs://``) through fsspec: probe, list, glob, stream, settle signature.

Every request to a store has a deadline that a slow, silent or dripping store cannot extend (``Deadlines``): a
look-up or one listing page ends within the connect plus read timeout, an object's download within that plus its
size over ``DEFAULT_STORAGE_MIN_RATE``. Requests go through fsspec's documented async methods (``_info``,
``_exists``, ``_find``, ``_cat_file``: fsspec's async guide), each run on the filesystem's event loop with fsspec's
``sync(..., timeout=)``, so a deadline cancels the request itself. Two S3 requests are made here, over the client
s3fs hands out, because fsspec's calls cannot keep their bounds: a listing, one page at a time (``_s3_listing``),
and a download, one streamed GET (``_chunks``). An object is read as the extraction asks for it, one chunk at a
time: no thread of ours waits on a store.

One translation point turns whatever the storage library raises into a ``PublishError`` naming the URL and the cause,
secrets blanked. Nothing here writes to disk: ``extract`` and ``publish`` write from the streams handed out here.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import re
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Type,
    TypeVar,
)

from lora_sampler._adapters.archive import CONFIG_FILE, Chunks
from lora_sampler._defaults import DEFAULT_STORAGE_MIN_RATE, DEFAULT_TIMEOUT
from lora_sampler._wire.archives import has_archive_suffix
from lora_sampler.errors import LoraSamplerError, PublishError
from lora_sampler.types import Timeout, is_storage_url, split_timeout

__all__ = [
    "DOWNLOAD_CHUNK_SIZE",
    "Chunks",
    "Deadlines",
    "StorageOptions",
    "StoredObject",
    "deadlines",
    "expand",
    "is_storage_url",
    "list_folder",
    "look_up",
    "open_object",
    "probe",
    "read_bytes",
    "settle_signature",
]

logger = logging.getLogger(__name__)

#: Bytes per read from the store: 1 MiB reads of one streamed GET ran at 0.8-1.2 GB/s on a loopback S3 server.
DOWNLOAD_CHUNK_SIZE = 1 << 20
#: Block size of the ranged reads on stores without a streamed GET (gcsfs): few requests, bounded memory.
RANGED_BLOCK_SIZE = 16 << 20
#: The most bytes one S3 listing page can hold: 1,000 keys of up to 1,024 bytes, each with its XML around it. A page
#: has the deadline of an object of this size.
LIST_PAGE_BYTES = 1000 * 1600
#: Keys an S3 listing page holds at most (``MaxKeys``); a listing of N keys takes ceil(N / 1,000) pages.
KEYS_PER_PAGE = 1000
#: Most keys one listing may hold (``storage_options={"max_listed_keys": N}``, the CLI's ``--max-listed-keys``):
#: a store whose pages never end is cut after this many keys' pages (1,000 pages), while a real bucket of 100,000
#: keys lists in full ten times over.
DEFAULT_MAX_LISTED_KEYS = 1_000_000
#: The storage option naming the listing bound: lora_sampler's own, taken out before fsspec sees the options.
MAX_LISTED_KEYS_OPTION = "max_listed_keys"

_GLOB_CHARS = re.compile(r"[*?\[]")
# scheme -> (the fsspec implementation's package, the lora_sampler extra that installs it)
_BACKENDS: Dict[str, Tuple[str, str]] = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
# Environment variables whose values are secrets, blanked from every message like the storage options' own.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_CREDENTIALS_FIX = (
    "check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role for s3://, "
    "GOOGLE_APPLICATION_CREDENTIALS for gs://, or SamplerClient(storage_options={...})"
)
# Exception class names (of botocore, aiohttp and the stdlib) that mean the store could not be reached at all.
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionRefusedError"}
# Storage options that s3fs hands on to a request (s3_additional_kwargs) and that a read needs too.
_S3_READ_KEYS = ("RequestPayer", "ExpectedBucketOwner", "SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5")

T = TypeVar("T")


class StoreTimeoutError(OSError):
    """A request to a store did not end within its deadline (raised to the caller as a ``PublishError``).

    Not a ``TimeoutError``: fsspec's ``sync`` turns those into its own ``FSTimeoutError`` without the message.
    """

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} did not end within {seconds:.1f} s")
        self.what = what
        self.seconds = seconds


class ListingTooLongError(OSError):
    """A listing went on past ``max_listed_keys`` (its pages never end, or the prefix is far too wide)."""

    def __init__(self, prefix: str, limits: Deadlines) -> None:
        super().__init__(
            f"the store's listing of {prefix!r} goes on past max_listed_keys={limits.max_listed_keys} "
            f"({limits.listing_pages} pages of up to {KEYS_PER_PAGE:,} keys)"
        )


class ObjectChangedError(OSError):
    """The object was rewritten between its look-up and its download (S3 answered 412 to ``If-Match``)."""


# S3 error codes and statuses (botocore's ClientError.response) by the error they mean here, in this order.
_S3_MEANINGS: Tuple[Tuple[Set[str], Type[OSError]], ...] = (
    ({"412", "PreconditionFailed"}, ObjectChangedError),
    ({"404", "NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion"}, FileNotFoundError),
    (
        {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"},
        PermissionError,
    ),
)


@dataclass(frozen=True)
class Deadlines:
    """The bounds of every request to a store: a metadata request, and an object's whole transfer.

    Attributes:
        connect: Seconds to connect (the client's connect timeout, or the storage options' ``connect_timeout``).
        read: Seconds to wait for an answer (the client's read timeout, or the options' ``read_timeout``).
        min_rate: Bytes per second an object's transfer may not fall below on average (``DEFAULT_STORAGE_MIN_RATE``).
        max_listed_keys: Most keys one listing may hold (``DEFAULT_MAX_LISTED_KEYS``).
    """

    connect: float
    read: float
    min_rate: float = DEFAULT_STORAGE_MIN_RATE
    max_listed_keys: int = DEFAULT_MAX_LISTED_KEYS

    @property
    def listing_pages(self) -> int:
        """Pages one listing may take: ``max_listed_keys`` at 1,000 keys a page, rounded up."""
        return -(-self.max_listed_keys // KEYS_PER_PAGE)

    @property
    def listing(self) -> float:
        """Seconds a whole listing may take: each of its pages' bound (a store with many pages is given no more)."""
        return self.listing_pages * self.transfer(LIST_PAGE_BYTES)

    @property
    def request(self) -> float:
        """Seconds a HEAD (or any request whose answer is small) may take in all, the library's retries included."""
        return self.connect + self.read

    def transfer(self, size: int) -> float:
        """Seconds the transfer of ``size`` bytes may take in all: a request's bound plus the size over the rate."""
        return self.request + max(size, 0) / self.min_rate


class StorageOptions(Dict[str, Any]):
    """A client's storage options (what fsspec is given) with the client's ``timeout`` they are used under.

    The client hands this one mapping to publishing and to a sweep's listings, so every storage request it makes is
    held to its ``timeout`` without a second argument on every path; fsspec receives a plain copy of the options.
    """

    def __init__(self, options: Optional[Mapping[str, Any]] = None, *, timeout: Optional[Timeout] = None) -> None:
        super().__init__(options or {})
        #: The client's ``(connect, read)`` timeout, or None for the default.
        self.timeout = timeout


def deadlines(options: Optional[Mapping[str, Any]] = None) -> Deadlines:
    """Return the deadlines of a store's requests: the storage options' own timeouts, else the client's.

    ``storage_options={"config_kwargs": {"connect_timeout": ..., "read_timeout": ...}}`` (s3fs's botocore settings)
    wins over a ``StorageOptions``' timeout (the client's); without either, the client's default ``(10, 300)``.
    ``storage_options={"max_listed_keys": N}`` bounds a listing (``DEFAULT_MAX_LISTED_KEYS``).

    Raises:
        PublishError: ``max_listed_keys`` is not a whole number of at least 1.
    """
    timeout = getattr(options, "timeout", None)
    connect, read = split_timeout(DEFAULT_TIMEOUT if timeout is None else timeout)
    config = (options or {}).get("config_kwargs") or {}
    if isinstance(config, Mapping):
        connect = float(config.get("connect_timeout", connect))
        read = float(config.get("read_timeout", read))
    most = (options or {}).get(MAX_LISTED_KEYS_OPTION, DEFAULT_MAX_LISTED_KEYS)
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise PublishError(
            f"storage_options={{{MAX_LISTED_KEYS_OPTION!r}: {most!r}}} must be a whole number of keys >= 1 (default "
            f"{DEFAULT_MAX_LISTED_KEYS:,}); the CLI's --max-listed-keys sets it"
        )
    return Deadlines(connect, read, max_listed_keys=most)


@dataclass(frozen=True)
class StoredObject:
    """What the store says of a checkpoint URL (one look-up), or of one object of a stored folder (its listing).

    Attributes:
        url: The URL as given (``s3://bucket/key``), or the object's own URL in a folder.
        size: The object's size in bytes (0 for a folder).
        etag: The store's ETag, or None.
        version: The object's version (S3 ``VersionId``, GCS generation), or None.
        is_folder: The URL is a prefix (an adapter folder), not an object.
        modified: When the object was last written (seconds since the epoch), or None when the store does not say.
        rel: An object's path below the folder it was listed in (``list_folder``); "" otherwise.
    """

    url: str
    size: int
    etag: Optional[str]
    version: Optional[str]
    is_folder: bool
    modified: Optional[float] = None
    rel: str = ""


def probe(url: str, options: Optional[Mapping[str, Any]] = None) -> StoredObject:
    """Ask the store about ``url`` with one look-up (fsspec's ``_info``: a HEAD; a one-key listing for a prefix).

    Raises:
        PublishError: the extra is not installed, or the object/bucket is missing, access is denied, the store is
            unreachable or did not answer within its deadline.
    """
    fs, path, limits = _filesystem(url, options)
    with translated(url, options, "look up"):
        info = _bounded(fs, fs._info(path), limits.request, "the look-up")
    if info.get("type") == "directory":
        return StoredObject(url, 0, None, None, True)
    version = info.get("VersionId") or info.get("generation")
    return StoredObject(url, int(info.get("size") or 0), _etag(info), _text(version), False, _modified(info))


def list_folder(url: str, options: Optional[Mapping[str, Any]] = None) -> List[StoredObject]:
    """List every object below the prefix ``url`` (recursively), sorted by path below it.

    Zero-byte ``folder/`` placeholder objects that consoles create are skipped. A key is taken as it is: the file
    ``x`` of ``step-7//x`` is fetched by its own URL; two keys that would be one file are refused.
    """
    fs, path, limits = _filesystem(url, options)
    root = path.rstrip("/") + "/"
    files: Dict[str, StoredObject] = {}
    with translated(url, options, "list"):
        for name, info in _listing(fs, root, limits, options, one_level=False).items():
            rel = name[len(root) :].lstrip("/")
            if not rel or name.endswith("/") or info.get("type") == "directory":
                continue  # the prefix itself, or a console's folder placeholder
            file_url = f"{url.rstrip('/')}/{name[len(root):]}"  # the object's own URL, double slashes kept
            if rel in files:
                raise OSError(f"two objects would be the adapter's file {rel!r}: {files[rel].url} and {file_url}")
            size = int(info.get("size") or 0)
            files[rel] = StoredObject(file_url, size, _etag(info), None, False, _modified(info), rel)
    return sorted(files.values(), key=lambda file: file.rel)


def look_up(url: str, options: Optional[Mapping[str, Any]] = None) -> Tuple[StoredObject, List[StoredObject]]:
    """Return what a checkpoint URL names now: an object and no files, or a prefix and the objects below it.

    An archive's URL is looked up (one HEAD); any other is listed first, which is a prefix's whole answer in one
    request, and looked up only when nothing is below it (an object without an archive suffix, a prefix holding only
    a folder placeholder, or nothing yet): that listing already said a prefix holds no files, so it is not made again.

    Raises:
        PublishError: nothing is there (its cause a ``FileNotFoundError``), or the store failed (see ``probe``).
    """
    files = [] if has_archive_suffix(url) else list_folder(url, options)
    if files:
        return StoredObject(url, 0, None, None, True), files
    return probe(url, options), []


def expand(pattern: str, options: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Return the checkpoints a storage URL or glob names now: archive objects and prefixes.

    A URL without glob characters that names nothing (yet) gives an empty list, so a watch can wait for it. In a
    glob, ``*`` and ``?`` stay within one path segment, ``**`` crosses them, ``[...]`` is a set of characters; a
    glob whose wildcards are in its last segment lists that level only.
    """
    fs, path, limits = _filesystem(pattern, options)
    wildcard = _GLOB_CHARS.search(path)
    with translated(pattern, options, "list"):
        if wildcard is None:
            return [pattern] if _bounded(fs, fs._exists(path), limits.request, "the look-up") else []
        root = path[: path.rfind("/", 0, wildcard.start()) + 1]
        one_level = "/" not in path[len(root) :] and "**" not in path
        listed = _listing(fs, root, limits, options, one_level=one_level)
    scheme = pattern.split("://", 1)[0]
    matcher = _glob_regex(path)
    return [
        f"{scheme}://{name}"
        for name, is_folder in _names_below(listed, root).items()
        if matcher.fullmatch(name) and (is_folder or has_archive_suffix(name))
    ]


def _names_below(listed: Mapping[str, Mapping[str, Any]], root: str) -> Dict[str, bool]:
    """Every name a listing of ``root`` shows, and the folders its keys imply below ``root``: name -> is a folder."""
    folders: Dict[str, bool] = {}
    for name, info in listed.items():
        bare = name.rstrip("/")
        folders[bare] = folders.get(bare, False) or name.endswith("/") or info.get("type") == "directory"
        parts = name[len(root) :].split("/")
        for depth in range(1, len(parts)):
            folders[root + "/".join(parts[:depth])] = True
    return folders


def settle_signature(url: str, options: Optional[Mapping[str, Any]] = None) -> Tuple[float, Optional[str], Any]:
    """Return ``(newest write time, problem, signature)`` of a stored checkpoint, for a sweep's settle rule.

    An object is written whole (a store never shows half an upload), so it has no problem; its signature is its
    ETag, version and size. A prefix's signature is its objects' paths, ETags and sizes; until one of them is
    ``adapter_config.json`` it is not complete. One request (``look_up``): a HEAD for an archive, a listing for a
    prefix.

    Raises:
        FileNotFoundError: nothing is at ``url`` (yet).
        PublishError: the store refused, could not be reached, or did not answer in time.
    """
    with _absent_as_not_found(url):
        stored, files = look_up(url, options)
    if not stored.is_folder:
        return (stored.modified or 0.0, None, ("object", stored.etag, stored.version, stored.size))
    newest = max((f.modified or 0.0 for f in files), default=0.0)
    has_config = any(f.rel.split("/")[-1] == CONFIG_FILE and f.rel.count("/") <= 1 for f in files)
    problem = None if has_config else f"its {CONFIG_FILE} is not in the store yet"
    return (newest, problem, ("prefix", tuple((f.rel, f.etag, f.size) for f in files)))


def read_bytes(url: str, options: Optional[Mapping[str, Any]] = None) -> bytes:
    """Return a small object's bytes (a training run's manifest), read as ``open_object`` reads an object.

    On S3 that is one GET, whose ``Content-Length`` sets its download's deadline; elsewhere a look-up for the size,
    then its ranges. The read is not tied to an ETag: a manifest rewritten meanwhile is read as it is now.

    Raises:
        FileNotFoundError: there is no such object (yet).
        PublishError: the store refused, could not be reached, or did not send it in time.
    """
    fs, path, limits = _filesystem(url, options)
    with _absent_as_not_found(url), translated(url, options, "read"):
        # On S3 the size is left for the GET to say (0 until then: its headers are held to a request's bound).
        size = 0 if _is_s3(fs) else int(_bounded(fs, fs._info(path), limits.request, "the look-up").get("size") or 0)
        return b"".join(_chunks(fs, path, StoredObject(url, size, None, None, False), limits, options))


@contextmanager
def _absent_as_not_found(url: str) -> Iterator[None]:
    """Raise a missing object as ``FileNotFoundError`` (a watch waits for it), every other failure unchanged."""
    try:
        yield
    except PublishError as error:
        if isinstance(error.__cause__, FileNotFoundError):
            raise FileNotFoundError(url) from error
        raise


def open_object(stored: StoredObject, options: Optional[Mapping[str, Any]] = None) -> Chunks:
    """Read one object as its chunks, each fetched when the reader asks for the next (one chunk in memory at a time);
    closing the generator ends the download, also when the reader stops early.

    On S3 the object is one GET (``If-Match`` its probed ETag, so a rewrite mid-way fails instead of mixing two
    versions) read in ``DOWNLOAD_CHUNK_SIZE`` steps; elsewhere ``RANGED_BLOCK_SIZE`` ranges (fsspec's ``_cat_file``).
    The store's time (not the time the extraction takes) is held to ``Deadlines.transfer`` of the object's size:
    each read gets what is left of it, and is cancelled when that passes.

    Raises:
        PublishError: (on a read) the connection dropped, the object changed, it ended short of its size, or the
            store did not send it within its deadline.
    """
    fs, path, limits = _filesystem(stored.url, options)
    return _download(_chunks(fs, path, stored, limits, options), stored, options)


def _download(chunks: Chunks, stored: StoredObject, options: Optional[Mapping[str, Any]]) -> Chunks:
    """Hand on an object's chunks: a download error raised as a ``PublishError`` naming the URL (secrets blanked),
    an object that ends before its size refused, the download closed when the reader closes this generator."""
    received = 0
    try:
        with translated(stored.url, options, "download"):
            for chunk in chunks:
                received += len(chunk)
                yield chunk
    finally:
        chunks.close()
    if received != stored.size:
        raise PublishError(
            f"cannot download {stored.url}: the object ended after {received} of its {stored.size} bytes (it "
            "changed, or the connection dropped); nothing was published. Publish it again"
        )


def _chunks(
    fs: Any, path: str, stored: StoredObject, limits: Deadlines, options: Optional[Mapping[str, Any]]
) -> Chunks:
    """Yield the object's bytes in order: on S3 the chunks of one streamed GET, elsewhere its ranges.

    fsspec reads a range whole per request (``_cat_file``; gcsfs has nothing else), and s3fs's ``open_async``
    neither sends ``If-Match`` nor releases its connection when a reader stops early. So on S3 the GET is made here,
    with botocore's documented ``get_object`` on s3fs's client: ``If-Match`` the looked-up ETag (or the version),
    its body released when the reading ends, however it ends. A loopback 200 MiB object took 0.27 s so, 1.7 s in
    16 MiB ranges (moto reads the whole object for each range; ``benchmarks/bench_storage_read.py``). Each request
    gets what is left of the transfer deadline of the object's size (the GET's ``Content-Length`` on S3); the time
    the reader takes between chunks is not the store's.
    """
    size, body = stored.size, None

    async def read(start: int) -> Optional[bytes]:
        nonlocal size, body
        if not _is_s3(fs):
            end = min(start + RANGED_BLOCK_SIZE, size)
            return await fs._cat_file(path, start=start, end=end) if start < end else b""
        if body is not None:
            return await _read_up_to(body, DOWNLOAD_CHUNK_SIZE)
        answer = await _s3(fs, lambda client: client.get_object(**_get_request(fs, path, stored, options)))
        size, body = int(answer.get("ContentLength") or 0), answer["Body"]
        return None  # the headers: the size is known now, the bytes follow

    spent, received = 0.0, 0
    try:
        while True:
            began = time.monotonic()
            try:
                block = _bounded(fs, read(received), limits.transfer(size) - spent, "download")
            except StoreTimeoutError:
                raise StoreTimeoutError(f"the download of {size} bytes", limits.transfer(size)) from None
            spent += time.monotonic() - began
            if block is None:
                continue  # the GET's headers: its size is known now
            if not block:
                return
            received += len(block)
            yield bytes(block)
    finally:
        if body is not None:
            with suppress(Exception):
                _bounded(fs, _release(body), limits.request, "closing the download")


def _get_request(fs: Any, path: str, stored: StoredObject, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """botocore's ``get_object`` arguments: the object, pinned to its version, else ``If-Match`` its ETag."""
    bucket, key, version = fs.split_path(path)
    request = dict(_s3_extra(options, listing=False), Bucket=bucket, Key=key)
    if version or stored.version:
        request["VersionId"] = version or stored.version
    elif stored.etag:
        request["IfMatch"] = stored.etag
    return request


async def _release(body: Any) -> None:
    """Close a GET's body, releasing its connection (aiobotocore's async close; older releases close in sync)."""
    closing = getattr(body, "aclose", None)
    await closing() if closing is not None else body.close()


async def _read_up_to(body: Any, size: int) -> bytes:
    """Read ``size`` bytes (fewer only at the end) inside the event loop: one hand-off per chunk.

    The response body hands out what the socket has (typically 64-512 KiB pieces); gathering a whole chunk inside the
    loop keeps the hand-offs between the loop's thread and the reading thread few.
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


def _listing(
    fs: Any, root: str, limits: Deadlines, options: Optional[Mapping[str, Any]], *, one_level: bool
) -> Dict[str, Dict[str, Any]]:
    """Every object below ``root`` (only its first level's objects and folders, ``one_level``): name -> info.

    On S3, page by page (``_s3_listing``); elsewhere fsspec's ``_find`` under the whole listing's deadline.

    Raises:
        ListingTooLongError: the listing holds more than ``max_listed_keys`` keys.
    """
    if _is_s3(fs):
        return _s3_listing(fs, root, limits, options, "/" if one_level else "")
    listing = fs._find(root, maxdepth=1 if one_level else None, withdirs=True, detail=True)
    found: Dict[str, Dict[str, Any]] = _bounded(fs, listing, limits.listing, "the listing")
    if len(found) > limits.max_listed_keys:
        raise ListingTooLongError(root, limits)
    return found


def _s3_listing(
    fs: Any, root: str, limits: Deadlines, options: Optional[Mapping[str, Any]], delimiter: str
) -> Dict[str, Dict[str, Any]]:
    """List ``root`` on S3 one ``ListObjectsV2`` page at a time, each page within its own deadline.

    fsspec's listing calls (``_find``, ``_ls``) fetch every page in one call, so they can keep neither a page's
    deadline (a dripping store would hold the whole listing's) nor the count of pages (s3fs follows the
    continuation tokens itself, a repeated one too): the pages are asked for here, with botocore's documented
    ``list_objects_v2`` on the client s3fs hands out (``set_session``). A listing is cut after
    ``limits.listing_pages`` pages, and one whose continuation token or key comes back is refused (it never ends).
    """
    bucket, prefix, _ = fs.split_path(root)
    request = dict(_s3_extra(options, listing=True), Bucket=bucket, Prefix=prefix, Delimiter=delimiter)
    found: Dict[str, Dict[str, Any]] = {}
    tokens: Set[str] = set()
    for _ in range(limits.listing_pages):
        listing = _s3(fs, lambda client: client.list_objects_v2(**request))
        page = _bounded(fs, listing, limits.transfer(LIST_PAGE_BYTES), "a listing page")
        for common in page.get("CommonPrefixes") or ():
            found.setdefault(f"{bucket}/{common['Prefix']}", {"type": "directory"})
        for entry in page.get("Contents") or ():
            name = f"{bucket}/{entry['Key']}"
            if name in found:
                raise OSError(f"the store's listing of {prefix!r} names {entry['Key']!r} twice (it does not end)")
            found[name] = {**entry, "type": "file", "size": entry.get("Size")}
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if not token:
            return found
        if token in tokens:
            raise OSError(f"the store's listing of {prefix!r} does not end (its continuation token repeats)")
        tokens.add(token)
        request["ContinuationToken"] = token
    raise ListingTooLongError(prefix, limits)


async def _s3(fs: Any, call: Callable[[Any], Awaitable[Dict[str, Any]]]) -> Dict[str, Any]:
    """Make one of botocore's documented S3 requests on the client s3fs hands out (``set_session``, documented).

    A missing object or bucket, a refusal and a failed ``If-Match`` are raised as what they mean here.
    """
    client = await fs.set_session()
    try:
        return await call(client)
    except Exception as error:
        meaning = _s3_error(error)
        if meaning is error:
            raise
        raise meaning from error


def _s3_extra(options: Optional[Mapping[str, Any]], *, listing: bool) -> Dict[str, Any]:
    """The storage options s3fs adds to its own requests that the requests made here need too."""
    extra = dict((options or {}).get("s3_additional_kwargs") or {})
    if (options or {}).get("requester_pays"):
        extra["RequestPayer"] = "requester"
    keys = _S3_READ_KEYS[:2] if listing else _S3_READ_KEYS  # the customer key headers belong to objects
    return {key: extra[key] for key in keys if key in extra}


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a storage glob: ``**`` any characters, ``*`` and ``?`` within a segment, ``[...]`` a set."""
    out: List[str] = []
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in pattern[index + 2 :]:
            end = pattern.index("]", index + 2)  # a "]" right after "[" is one of the set's characters
            body = pattern[index + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            index = end + 1
            continue
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out), re.DOTALL)


def _bounded(fs: Any, coroutine: Awaitable[T], seconds: float, what: str) -> T:
    """Run one of fsspec's documented async methods on the filesystem's loop; cancel it after ``seconds``.

    fsspec's ``sync(loop, ..., timeout=)`` wraps the coroutine in ``asyncio.wait_for``: when the deadline passes,
    the request itself is cancelled (its connection closed) and ``StoreTimeoutError`` raised.
    """
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    async def bounded() -> T:
        return await coroutine

    try:
        return sync(fs.loop, bounded, timeout=max(seconds, 0.001))  # type: ignore[no-any-return]
    except FSTimeoutError:
        raise StoreTimeoutError(what, seconds) from None


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
    if isinstance(error, StoreTimeoutError):
        message = (
            f"cannot {action} {url}: the store was too slow ({error}; a request has the connect plus read timeout, "
            "a download that plus its size at the minimum rate); nothing was published. Check the store, or give "
            "a longer timeout: SamplerClient(timeout=(connect, read)) (the CLI's --timeout CONNECT,READ) or "
            "storage_options={'config_kwargs': {'read_timeout': ...}}"
        )
    elif isinstance(error, ListingTooLongError):
        message = (
            f"cannot {action} {url}: {error}; nothing was published. Narrow the URL or glob to the checkpoints you "
            f"mean, or raise the bound: storage_options={{{MAX_LISTED_KEYS_OPTION!r}: ...}} (the CLI's "
            "--max-listed-keys)"
        )
    elif isinstance(error, ObjectChangedError):
        message = (
            f"cannot {action} {url}: the object was rewritten in the store after it was looked up ({cause}); "
            "nothing was published. Publish it again to take its new content"
        )
    elif isinstance(error, FileNotFoundError):
        message = f"cannot {action} {url}: no such object, prefix or bucket ({cause}); check the URL"
    elif isinstance(error, PermissionError):
        message = f"cannot {action} {url}: access denied ({cause}); {_CREDENTIALS_FIX}"
    elif _unreachable(error):
        message = (
            f"cannot {action} {url}: the store cannot be reached ({cause}); nothing was published. Check the "
            "endpoint (AWS_ENDPOINT_URL or storage_options={'endpoint_url': ...} for an S3-compatible store) and "
            "the network, then try again"
        )
    else:
        message = f"cannot {action} {url}: {cause}; nothing was published. Try again"
    return PublishError(message)


def _unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the store could not be connected to at all."""
    seen: List[BaseException] = []
    current: Optional[BaseException] = error
    while current is not None and current not in seen:
        seen.append(current)
        if any(cls.__name__ in _UNREACHABLE for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def _s3_error(error: Exception) -> Exception:
    """Return what a botocore ``ClientError`` means here (changed, missing, denied), else ``error`` itself."""
    response = getattr(error, "response", None)
    if not isinstance(response, Mapping):
        return error
    details = response.get("Error") or {}
    status = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode"))
    code = str(details.get("Code") or status)
    for codes, meaning in _S3_MEANINGS:
        if {code, status} & codes:
            return meaning(f"{code}: {details.get('Message') or error}")
    return error


def _redacted(text: str, options: Optional[Mapping[str, Any]]) -> str:
    """Blank every secret-looking value of the options and the environment out of ``text``."""
    secrets = [os.environ.get(name) for name in _SECRET_ENV]
    secrets += [
        str(value) for key, value in _flat_items(options or {}) if _is_secret_key(key) and key != MAX_LISTED_KEYS_OPTION
    ]
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


def _filesystem(url: str, options: Optional[Mapping[str, Any]]) -> Tuple[Any, str, Deadlines]:
    """Return the fsspec filesystem for ``url`` (cached by fsspec per options), the URL's path, and the deadlines.

    On S3 the deadlines' connect and read timeouts also go to botocore (``config_kwargs``) unless the storage
    options set their own, so each single request is bounded the same way the whole call is.

    Raises:
        PublishError: the URL's extra is not installed (naming it), or the options are refused.
    """
    fsspec_core = _backend(url)
    limits = deadlines(options)
    settings = {key: value for key, value in (options or {}).items() if key != MAX_LISTED_KEYS_OPTION}
    # fsspec's documented DirCache option: every listing and look-up asks the store (a watch must see new keys).
    settings.setdefault("use_listings_cache", False)
    if url.lower().startswith("s3://"):
        config = dict(settings.get("config_kwargs") or {})
        config.setdefault("connect_timeout", limits.connect)
        config.setdefault("read_timeout", limits.read)
        settings["config_kwargs"] = config
    with translated(url, options, "open a storage client for"):
        # fsspec.core.url_to_fs: fsspec's documented way from a URL to its filesystem and the path within it.
        fs, path = fsspec_core.url_to_fs(url, **settings)
    return fs, path, limits


def _backend(url: str) -> Any:
    """Import fsspec and the URL's storage library (naming the extra that installs it); return ``fsspec.core``."""
    scheme = url.split("://", 1)[0].lower() if is_storage_url(url) else ""
    if scheme not in _BACKENDS:
        raise PublishError(f"{url!r} is not a storage URL; use one of {', '.join(s + '://' for s in _BACKENDS)}")
    package, extra = _BACKENDS[scheme]
    try:
        importlib.import_module(package)
        return importlib.import_module("fsspec.core")
    except ImportError as error:
        raise PublishError(
            f"cannot read {url}: {scheme}:// checkpoints need the optional extra lora_sampler[{extra}] "
            f"({error.name or package} is not installed); install it: pip install 'lora_sampler[{extra}]'"
        ) from None


def _is_s3(fs: Any) -> bool:
    return "s3" in getattr(fs, "protocol", ())


def _etag(info: Mapping[str, Any]) -> Optional[str]:
    """An object's ETag as s3fs (``ETag``) or gcsfs (``etag``) reports it, or None."""
    return _text(info.get("ETag") or info.get("etag"))


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
