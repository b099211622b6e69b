"""Where a sweep's checkpoints come from, and when one may be taken.

Owns pattern expansion in natural order (``step-200`` before ``step-1000``), the training run's manifest
(``checkpoints.jsonl``), the settle/complete probe of one checkpoint, and ``CheckpointSource``, which turns them into
checkpoints ready to evaluate, each once. Storage URLs (patterns, manifest paths, a manifest itself) are listed,
fingerprinted and read through the storage layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import posixpath
import re
import stat
import struct
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from lora_sampler._adapters import storage
from lora_sampler._adapters.archive import ADAPTER_FILE_NAMES, CONFIG_FILE, Chunks
from lora_sampler._adapters.extract import Members, read_archive
from lora_sampler._views import printable
from lora_sampler._wire.archives import has_archive_suffix, strip_archive_suffix
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.errors import (
    BatchInputError,
    CheckpointIncompleteError,
    CheckpointMissingError,
    IncompleteCheckpointError,
    LoraSamplerError,
    PublishError,
    UnsafeArchiveError,
)
from lora_sampler.types import is_storage_url

logger = logging.getLogger(__name__)

_GLOB_CHARS = re.compile(r"[*?\[]")
_DIGITS = re.compile(r"(\d+)")
_READ_CHUNK = 1 << 20
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
#: The longest safetensors header read, in bytes: the format's own reader refuses a longer one (the safetensors crate's
#: ``MAX_HEADER_SIZE``, its documented ``SafeTensorError::HeaderTooLarge``), so none is read into memory here either.
SAFETENSORS_HEADER_LIMIT = 100_000_000


def natural_key(text: str) -> Tuple[Union[str, int], ...]:
    """Return the sort key in which runs of digits compare as numbers (``step-200`` < ``step-1000``)."""
    parts = _DIGITS.split(text)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def step_of(path: str) -> Optional[int]:
    """Return the training step a checkpoint's name carries: its last run of digits (None without one)."""
    name = strip_archive_suffix(os.path.basename(path.rstrip("/")))
    runs = _DIGITS.findall(name)
    return int(runs[-1]) if runs else None


def _holds_adapter(path: str, real: str) -> bool:
    """An archive (by its name or its target's), or a folder with an adapter config or weights file."""
    if os.path.isdir(real):
        try:
            with os.scandir(real) as entries:
                return any(entry.name in ADAPTER_FILE_NAMES for entry in entries)
        except OSError:
            return False
    return has_archive_suffix(path) or has_archive_suffix(real)


def _local_matches(pattern: str) -> Dict[str, str]:
    """What a local path or glob matches now, by real path, in natural order: each real path once, under its own name
    if matched, else the first name.

    ``**`` matches folders recursively and follows symlinked folders, but each real folder is entered once per
    place in the pattern, so a symlink loop (``run/a -> .``) ends the walk instead of repeating it. A plain path
    that does not exist (yet) matches nothing, so a watch can wait for it.
    """
    matches: List[str] = []
    # The anchor keeps a drive or a share ("/", "C:\\", "\\\\host\\share\\"); the parts are the names below it.
    anchor, *parts = pathlib.PurePath(os.path.abspath(os.path.expanduser(pattern))).parts
    _match(anchor, parts, 0, matches, set())
    names: Dict[str, str] = {}  # real path -> the name it is listed under
    for match in sorted(set(matches), key=natural_key):
        real = os.path.realpath(match)
        if os.path.exists(real) and (real not in names or match == real):  # a dangling link matches nothing
            names[real] = match
    return names


def _match(folder: str, parts: List[str], at: int, found: List[str], walked: Set[Tuple[int, ...]]) -> None:
    """Add to ``found`` every path under ``folder`` that ``parts[at:]`` matches (hidden names only when asked), never
    walking a real folder twice for one part of the pattern (``walked``)."""
    if at == len(parts):
        found.append(folder)
        return
    part = parts[at]
    if part == "**":
        _match_any_depth(folder, parts, at, found, walked)
    elif not _GLOB_CHARS.search(part):
        full = os.path.join(folder, part)
        if os.path.lexists(full):
            _match(full, parts, at + 1, found, walked)
    else:
        for name in _names(folder):
            if (name.startswith(".") and not part.startswith(".")) or not fnmatch.fnmatchcase(name, part):
                continue
            _match(os.path.join(folder, name), parts, at + 1, found, walked)


def _match_any_depth(folder: str, parts: List[str], at: int, found: List[str], walked: Set[Tuple[int, ...]]) -> None:
    """``parts[at]`` is ``**``: match the rest in ``folder`` and in each visible folder below it, each real one once."""
    try:
        info = os.stat(folder)
    except OSError:
        return
    key = (info.st_dev, info.st_ino, at)
    if key in walked:
        return  # this real folder was walked for this part already: a symlink loop, or two links to it
    walked.add(key)
    _match(folder, parts, at + 1, found, walked)  # ** matching no folder
    for name in _names(folder):
        full = os.path.join(folder, name)
        if not name.startswith(".") and os.path.isdir(full):
            _match(full, parts, at, found, walked)


def _names(folder: str) -> List[str]:
    try:
        return os.listdir(folder)
    except OSError:  # not a folder, gone, or unreadable: it matches nothing below
        return []


def expand_pattern(pattern: str, storage_options: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Return the checkpoints (archives or adapter folders) a path or glob names now, in natural order, as a sweep
    lists them.

    A plain path that does not exist (yet) gives an empty list, so a watch can wait for it; one that exists is its
    checkpoint, whatever it holds (publishing it says what is wrong). ``**`` matches folders recursively. Local paths
    come back absolute, each real path once. A storage URL's pattern globs the store's listing (archive objects and
    prefixes), with ``storage_options``.
    """
    return [item.path for item in _expand([pattern], storage_options)]


# -- the settle/complete probe -----------------------------------------------------------------------------------


def checkpoint_fingerprint(
    path: str, storage_options: Optional[Mapping[str, Any]] = None, *, before: Tuple[Any, ...] = ()
) -> Tuple[float, Optional[str], str]:
    """Return ``(newest modification time, problem, signature)`` of a checkpoint, for the settle rule.

    ``newest modification time`` is in seconds since the epoch (a folder: its newest adapter file); ``problem`` is
    None when the checkpoint reads to its end (an archive: every member's data and the compression's end; a folder:
    adapter_config.json parses and each safetensors adapter file holds the bytes its header declares), else why it
    does not; ``signature`` is its ``content_signature``, which changes whenever the checkpoint does. The read to the
    end is skipped when ``before`` (the fingerprint of the last look) has the same signature, so probing a settled
    checkpoint again costs an open and an ``fstat`` per file. A storage URL costs one metadata request (a listing for
    a prefix): an object is written whole, so it always reads to its end, and a store that refuses or cannot be
    reached is its problem (retried at the next look).

    Raises:
        FileNotFoundError: nothing is at ``path`` (yet).
    """
    with contextlib.ExitStack() as opened:
        try:
            newest, problem, files, handles = _look(path, storage_options, opened)
        except PublishError as error:
            return (0.0, str(error), "unreachable")
        signature = _digest(files)
        if problem is not None or isinstance(files, tuple):  # a stored one reads to its end; an irregular one is unread
            return (newest, problem, signature)
        if tuple(before[2:]) == (signature,):
            return (newest, before[1], signature)
        folder = "" not in handles  # an archive's one file has no name
        return (newest, _folder_problem(handles) if folder else _archive_problem(path, handles[""]), signature)


def _look(
    path: str, storage_options: Optional[Mapping[str, Any]], opened: contextlib.ExitStack
) -> Tuple[float, Optional[str], Any, Dict[str, Any]]:
    """Return ``(newest modification time, problem, files, handles)`` of a checkpoint from one look that reads no
    data.

    ``files`` is what its signature digests: a stored one's ``("stored", its store signature)``, a local archive's
    ``[(size, mtime_ns, inode)]``, or a local folder's adapter files' ``[(name, size, mtime_ns, inode)]``. Each local
    file is opened first and signed from the open file (``fstat``), so what the probe reads (``handles``: ``""`` for
    an archive, else each file's name, closed with ``opened``) is the very file it signs. The ``problem`` of a local
    one is only one the look tells: a file that is no regular file (opened without waiting, ``O_NONBLOCK``, and
    never read, as a pipe waits for a writer for ever; publishing refuses it).

    Raises:
        FileNotFoundError: nothing is at ``path`` (yet).
        PublishError: the store refused, could not be reached, or did not answer in time.
    """
    if is_storage_url(path):
        newest, problem, stored = storage.settle_signature(path, storage_options)
        return newest, problem, ("stored", tuple(stored)), {}
    irregular = "{} is not a regular file (a folder, a pipe, a socket or a device): it is never read"
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        handle, st = _opened(path, opened)
        problem = None if handle is not None else irregular.format("it")
        return st.st_mtime, problem, [(st.st_size, st.st_mtime_ns, st.st_ino)], {"": handle}
    files: List[Tuple[Any, ...]] = []
    handles: Dict[str, Any] = {}
    problem = None
    for name in ADAPTER_FILE_NAMES:
        try:
            handles[name], st = _opened(os.path.join(path, name), opened)
        except FileNotFoundError:
            continue  # absent, or removed while we looked: the next look sees the change
        files.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        if problem is None and handles[name] is None:
            problem = irregular.format(f"its {name}")
    newest_ns = max((mtime_ns for _, _, mtime_ns, _ in files), default=info.st_mtime_ns)  # no file yet: the folder's
    return newest_ns / 1e9, problem, files, handles


def _opened(path: str, opened: contextlib.ExitStack) -> Tuple[Any, os.stat_result]:
    """Open ``path`` without waiting (``O_NONBLOCK``) and return ``(file, its fstat)``; the file is None when it is
    no regular file (or cannot be opened as one: a socket, a folder on Windows), which is then signed from ``stat``.

    Raises:
        FileNotFoundError: nothing is at ``path``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_BINARY)
    except FileNotFoundError:
        raise
    except OSError:
        return None, os.stat(path)
    handle = opened.enter_context(os.fdopen(fd, "rb", buffering=0))
    st = os.fstat(fd)
    return (handle if stat.S_ISREG(st.st_mode) else None), st


def _archive_problem(path: str, handle: Any) -> Optional[str]:
    """Return why an archive (open) does not read to its end (truncated, corrupted), or None when it does.

    Read as publishing reads it (``extract.read_archive``): every member's data, then the compressed stream to its
    very end, so its CRC and length are checked and nothing but zero padding follows the tar stream. A member that
    publishing refuses is not this probe's problem: publishing names it.
    """

    def chunks() -> Chunks:
        yield from iter(partial(handle.read, _READ_CHUNK), b"")

    try:
        read_archive(path, _read_members, chunks=chunks())
    except UnsafeArchiveError:
        return None
    except PublishError as error:
        cause = error.__cause__
        return f"it does not read to its end ({f'{type(cause).__name__}: {cause}' if cause else error})"
    return None


def _read_members(members: Members) -> None:
    """Take every member (``read_archive``'s consumer for the probe): the data of each is read past as the next is."""
    for _ in members:
        pass


def _folder_problem(handles: Dict[str, Any]) -> Optional[str]:
    """Return why an adapter folder (its adapter files, opened by ``_look``) is not complete yet, or None when it
    is."""
    try:
        config = handles.get(CONFIG_FILE)
        if config is None:
            raise FileNotFoundError(CONFIG_FILE)
        json.loads(config.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        return f"its {CONFIG_FILE} is missing or does not parse ({type(error).__name__})"
    for name in sorted(name for name in handles if name.endswith(".safetensors")):
        problem = _safetensors_problem(handles[name])
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _safetensors_problem(handle: Any) -> Optional[str]:
    """Return why a safetensors file (open) is shorter or longer than its header declares, or declares a header
    longer than the format allows, or None."""
    try:
        size = os.fstat(handle.fileno()).st_size
        (length,) = struct.unpack("<Q", handle.read(8)) if size >= 8 else (size + 1,)
        if length > SAFETENSORS_HEADER_LIMIT:  # no safetensors file, or a corrupted one: never read into memory
            return f"its header declares {length} bytes, more than safetensors reads ({SAFETENSORS_HEADER_LIMIT})"
        if 8 + length > size:
            return f"{size} bytes, shorter than its header"
        header = json.loads(handle.read(length).decode("utf-8"))
        ends = [
            entry["data_offsets"][1]
            for key, entry in header.items()
            if key != "__metadata__" and "data_offsets" in entry
        ]
        expected = 8 + length + max(ends, default=0)
    except (OSError, ValueError, struct.error, LookupError, TypeError, AttributeError) as error:
        return f"unreadable header ({type(error).__name__})"  # a header that is no object of tensors, too
    return None if size == expected else f"{size} bytes, its header declares {expected}"


def content_signature(path: str, storage_options: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Return a short signature of a checkpoint's bytes as its filesystem or store tells them, or None when it is
    absent or its store cannot be reached. Written to ``sweep.jsonl``, so a later run notices a checkpoint
    overwritten with other weights.

    It digests what the fingerprint's look sees, without reading the checkpoint: a local one costs an open and an
    ``fstat`` per file (size, times, inode; a folder: those of its adapter files), a storage URL one metadata request
    (an object: its ETag, version and size; a prefix: one listing of its objects' paths, ETags and sizes), bounded
    as every storage read is.
    """
    try:
        with contextlib.ExitStack() as opened:
            return _digest(_look(path, storage_options, opened)[2])
    except (OSError, PublishError):  # absent (FileNotFoundError) or unreachable: no signature to compare
        return None


def _digest(look: Any) -> str:
    """The signature of what a look at a checkpoint saw (its files' stat, or a stored one's own signature)."""
    return hashlib.blake2b(repr(look).encode(), digest_size=8).hexdigest()


# -- the manifest ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a training run.

    Attributes:
        path: The archive or folder (absolute) or storage URL, as named: the ``checkpoint`` of its ``sweep.jsonl`` line.
        step: The training step (the manifest's ``batch``/``step``, else the last number in the name), or None.
        name: The manifest's ``name``, or None.
        final: The manifest marks it as the run's last checkpoint.
        real: Its real path (symlinks resolved), when it differs from ``path``: what identifies it.
        problem: Why it cannot be used, the error its ``sweep.jsonl`` line records (a manifest line that is not JSON,
            a path outside the manifest's folder; absent or incomplete past its wait, as the source hands it out).
        replaces: The adapter an earlier evaluation of this checkpoint used, when its content changed since.
        signature: ``content_signature`` when it was handed out (written to the ledger).
    """

    path: str
    step: Optional[int] = None
    name: Optional[str] = None
    final: bool = False
    real: Optional[str] = None
    problem: Optional[LoraSamplerError] = None
    replaces: Optional[str] = None
    signature: Optional[str] = None

    @property
    def key(self) -> str:
        """What identifies the checkpoint across listings and runs: its real path (or URL)."""
        return self.real or self.path


@dataclass(frozen=True)
class Manifest:
    """A training run's ``checkpoints.jsonl``, as ``lora_sampler.sweep``'s ``checkpoints`` (re-read on a watch).

    Its sampler paths outside the manifest's folder (or store prefix) are taken only with the sweep's
    ``allow_outside_paths`` setting: a manifest is often written by other code, and every path it names is copied
    into the shared resolver folder.

    Attributes:
        path: The manifest (a local path or a storage URL).
    """

    path: str


def read_manifest(
    path: str, storage_options: Optional[Mapping[str, Any]] = None, *, allow_outside_paths: bool = False
) -> List[Checkpoint]:
    """Read a ``checkpoints.jsonl`` in file order: ``{"name", "sampler_path" (or "path"), "batch" (or "step"),
    "final"}`` per line; other fields are ignored, a line without a sampler path (a state-only save) is skipped,
    and a relative path resolves against the manifest's folder. A last line still being written is left for later.
    The manifest may itself be a storage URL (then a relative path is a key beside it).

    A complete line that is not a JSON object, or whose sampler path lies outside the manifest's folder (an absolute
    path elsewhere, ``..``; unless ``allow_outside_paths``), comes back as a ``Checkpoint`` with a ``problem``: the
    sweep records it as an error line and goes on.

    Raises:
        FileNotFoundError: there is no manifest at ``path`` (yet).
    """
    if is_storage_url(path):
        folder = path.rsplit("/", 1)[0]
        raw_lines = storage.read_bytes(path, storage_options).split(b"\n")
    else:
        folder = os.path.dirname(os.path.abspath(path))
        with open(path, "rb") as handle:
            raw_lines = handle.read().split(b"\n")
    checkpoints = []
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except ValueError:
            if number == len(raw_lines):  # no newline yet: the training run is writing this line
                break
            entry = None
        checkpoint = _manifest_entry(entry, folder, path, number, allow_outside_paths)
        if checkpoint is not None:
            checkpoints.append(checkpoint)
    return checkpoints


def _bad_line(path: str, number: int, why: str) -> Checkpoint:
    """The entry of a manifest line that cannot be used: keyed by the manifest and its line, recorded once."""
    return Checkpoint(f"{path}#line{number}", problem=BatchInputError(f"{path}: line {number} {why}"))


def _manifest_entry(entry: Any, folder: str, path: str, number: int, allow_outside_paths: bool) -> Optional[Checkpoint]:
    if not isinstance(entry, dict):
        shape = "is not JSON" if entry is None else "is not a JSON object"
        return _bad_line(
            path,
            number,
            f'{shape}; the manifest takes one JSON object a line, as {{"name": ..., '
            '"sampler_path": ..., "batch": ...}',
        )
    location = entry.get("sampler_path") or entry.get("path")
    if not location:
        return None  # a state-only save: nothing to sample
    if not isinstance(location, str):
        return _bad_line(path, number, "has a sampler_path that is not a string")
    try:
        if "\x00" in location:  # checked here: Python 3.9's realpath takes it (islink swallows the ValueError)
            raise ValueError("embedded null byte")
        os.fsencode(location)  # a lone surrogate cannot be encoded: no file has that name
        location, real, outside = _located(location, folder)
    except ValueError as error:  # a NUL byte, a lone surrogate: no path a file can have
        return _bad_line(path, number, f"has a sampler_path no file can have ({error})")
    step = entry.get("batch", entry.get("step"))
    name = entry.get("name")
    problem = None
    if outside and not allow_outside_paths:
        problem = BatchInputError(
            f"{path}: line {number} names {location}, outside the manifest's folder {folder}; every checkpoint is "
            "copied into the shared resolver folder, so a path elsewhere needs --allow-outside-paths "
            "(allow_outside_paths=True)"
        )
    return Checkpoint(
        location,
        step=step if isinstance(step, int) and not isinstance(step, bool) else step_of(location),
        name=name if isinstance(name, str) else None,
        final=entry.get("final") is True,
        real=real,
        problem=problem,
    )


def _located(location: str, folder: str) -> Tuple[str, Optional[str], bool]:
    """A manifest's sampler path as the sweep reads it (a relative one beside the manifest), its real path when that
    differs (symlinks resolved: what identifies the checkpoint), and whether it lies outside the manifest's folder
    (or store prefix)."""
    if is_storage_url(location):
        return location, None, not location.startswith(folder.rstrip("/") + "/")
    if "://" in location:
        return location, None, False  # a training service's own (tinker://), kept as written: nothing is copied here
    if is_storage_url(folder):
        relative = posixpath.normpath(location)
        outside = relative.startswith("../") or relative == ".." or location.startswith("/")
        return f"{folder}/{relative.lstrip('/')}", None, outside
    location = os.path.abspath(os.path.join(folder, os.path.expanduser(location)))
    real, base = os.path.realpath(location), os.path.realpath(folder)
    inside = real == base or real.startswith(base.rstrip(os.sep) + os.sep)
    return location, real if real != location else None, not inside


# -- the source --------------------------------------------------------------------------------------------------


Listing = Callable[[], List[Checkpoint]]


def listing(
    checkpoints: Union[str, Sequence[str], Manifest],
    settings: SweepSettings,
    storage_options: Optional[Mapping[str, Any]] = None,
) -> Listing:
    """Return the function that lists the checkpoints known now: patterns re-globbed, or the manifest re-read (its
    paths outside its folder taken with the settings' ``allow_outside_paths``, as ``read_manifest``).

    Patterns' matches are merged in natural order, each real path once; a manifest keeps its file order. A glob's
    match that holds no adapter file at all (``logs/``) is noted once (a log warning) and looked at again at the
    next listings.
    """
    if isinstance(checkpoints, Manifest):
        return partial(_reread, checkpoints.path, storage_options, settings.allow_outside_paths)
    patterns = [checkpoints] if isinstance(checkpoints, str) else list(checkpoints)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError("checkpoints takes a path or glob, a list of them, or a Manifest")
    noted: Set[str] = set()

    def note(path: str, real: str) -> None:
        if real not in noted:
            noted.add(real)
            logger.warning(
                "%s holds no adapter file (no archive suffix; a folder without %s or adapter weights): skipped%s",
                printable(path),
                CONFIG_FILE,
                ", looked at again at the next listings" if settings.watch else "",
            )

    return lambda: _expand(patterns, storage_options, note)


def _reread(path: str, storage_options: Optional[Mapping[str, Any]], allow_outside_paths: bool) -> List[Checkpoint]:
    """The listing of a manifest: its checkpoints in file order, none while it is not written yet."""
    try:
        return read_manifest(path, storage_options, allow_outside_paths=allow_outside_paths)
    except FileNotFoundError:  # not written yet: a watch waits for it
        return []


def _expand(
    patterns: List[str],
    storage_options: Optional[Mapping[str, Any]],
    note: Callable[[str, str], None] = lambda path, real: None,
) -> List[Checkpoint]:
    """Every pattern's matches now, each real path once, in natural order; a glob's match without an adapter file
    is handed to ``note`` (with its real path) instead (a plain path names its checkpoint, whatever it holds)."""
    found: Dict[str, Checkpoint] = {}
    for pattern in patterns:
        if is_storage_url(pattern):
            for url in storage.expand(pattern, storage_options):
                found.setdefault(url, Checkpoint(url, step=step_of(url)))
            continue
        named = not _GLOB_CHARS.search(pattern)
        for real, path in _local_matches(pattern).items():
            if named or _holds_adapter(path, real):
                found.setdefault(real, Checkpoint(path, step=step_of(path), real=real if real != path else None))
            else:
                note(path, real)
    return sorted(found.values(), key=lambda item: natural_key(item.path))


#: What a look at a checkpoint saw (``checkpoint_fingerprint``); one that is absent has no signature.
Fingerprint = Tuple[float, Optional[str], Optional[str]]
_ABSENT: Fingerprint = (0.0, None, None)  # the fingerprint of a checkpoint not (yet) there, or not looked at yet


@dataclass
class _Pending:
    """A listed checkpoint not handed out yet, what the source saw of it (its last fingerprint) and since when."""

    checkpoint: Checkpoint
    first_seen: float
    fingerprint: Fingerprint = _ABSENT
    since: float = 0.0  # when ``fingerprint`` was first seen as it is (set with it, by ``_ready``)


#: Seconds between listings while nothing listed is ready, at the least (more when a listing is slow: see poll).
RELIST_SECONDS = 0.25


class CheckpointSource:
    """Hand out each checkpoint once it is complete, in the listing's order, each real path once.

    The listing runs once, then again only when nothing already listed is ready (and at most every
    ``RELIST_SECONDS``, or ten times as long as a listing takes), so its cost per checkpoint does not grow with the
    folder. A checkpoint is ready once its fingerprint stayed the same for the ``settle`` seconds of the settings (or
    its newest file is older than that) and it reads to its end. Every wait is bounded: an absent or unfinished
    checkpoint is waited for at most ``checkpoint_timeout`` seconds from when it was first seen (absent ones only
    under a ``watch``; without one an absent checkpoint and a settled one that does not read to its end are given up
    on at once), then it comes out with its ``problem`` set (the error its ledger line records). A watch ends
    ``idle_timeout`` seconds after the last news once nothing is pending, or once the manifest's ``final`` checkpoint
    is finished. A match that holds no adapter file at all is the listing's to note (``listing``).

    Args:
        list_checkpoints: The listing (``listing``).
        settings: The sweep's settings: its ``watch``, ``settle``, ``idle_timeout`` and ``checkpoint_timeout``.
        skip: Checkpoints already done: the ledger's finished lines by ``ledger_key`` (a checkpoint whose
            ``content_signature`` differs from its line's ``signature`` is handed out again, naming the line's adapter
            as ``replaces``).
        storage_options: Passed to ``checkpoint_fingerprint``.
        clock: The monotonic clock (tests drive it).
    """

    def __init__(
        self,
        list_checkpoints: Listing,
        settings: SweepSettings,
        *,
        skip: Optional[Mapping[str, Mapping[str, Any]]] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._list, self._settings = list_checkpoints, settings
        self._storage_options, self._clock = storage_options, clock
        #: The ledger line of each checkpoint done (evaluated, or recorded as failed in this run), by its key.
        self._done: Dict[str, Mapping[str, Any]] = dict(skip or {})
        self._pending: Dict[str, _Pending] = {}
        self._taken: Set[str] = set()
        self._final: Optional[str] = None
        self._listed_at: Optional[float] = None
        self._listing_seconds = 0.0
        self._store_unanswered = False  # a change check of this listing found the store silent or unreachable
        self._emptied_at: Optional[float] = None  # when the last pending checkpoint went
        self._last_news = clock()
        #: True once nothing is left to hand out (and, watching, the watch ended).
        self.ended = False
        #: Why it ended, for a person: every checkpoint listed was taken, the watch's idle time ran out, or the
        #: manifest's final checkpoint is done.
        self.end_reason = ""

    def finished(self, key: str, line: Mapping[str, Any]) -> None:
        """Record that checkpoint ``key`` was evaluated or given up on (its ledger ``line``, whose ``signature`` and
        ``adapter`` tell a later change of its content): a watch counts its idle time from here."""
        self._taken.discard(key)
        self._done[key] = line
        self._last_news = self._clock()

    def listed(self) -> int:
        """List now (if not done yet) and return how many checkpoints wait to be handed out."""
        if self._listed_at is None:
            self._relist(self._clock())
        return len(self._pending)

    def poll(self) -> Optional[Checkpoint]:
        """Return the next ready checkpoint, one given up on (its ``problem`` says why), or None (nothing ready now;
        see ``ended``)."""
        if self.ended:
            return None
        now = self._clock()
        item = self._take(now)
        if item is not None or self._pending:  # each pending checkpoint is bounded by checkpoint_timeout
            return item
        if not self._settings.watch:
            self.end_reason = "every checkpoint listed was taken (pass --watch to follow a run still training)"
        elif self._final_done():
            self.end_reason = f"the manifest's final checkpoint ({printable(self._final or '')}) is done"
        elif now - self._last_news < self._settings.idle_timeout:
            return None
        else:
            self.end_reason = f"--watch saw nothing new for {self._settings.idle_timeout:g} s (--idle-timeout)"
        self.ended = True
        return None

    def waiting_for(self) -> str:
        """Say what the source waits for now (after a ``poll`` that returned None), with the bound of the wait."""
        now = self._clock()
        for pending in self._pending.values():
            name = printable(pending.checkpoint.path)
            left = max(0.0, self._settings.checkpoint_timeout - (now - pending.first_seen))
            bound = f"--checkpoint-timeout {self._settings.checkpoint_timeout:g} s, {left:.0f} s left"
            if pending.fingerprint[2] is not None:
                settle = f"{self._settings.settle:g} s unchanged"
                return f"waiting for {name} to be complete (still being written; {settle}; {bound})"
            return f"waiting for {name}, named but not there yet; {bound}"  # the countdown after the ";"
        left = max(0.0, self._settings.idle_timeout - (now - self._last_news))
        return (
            f"waiting for a new checkpoint; the watch ends after {self._settings.idle_timeout:g} s with nothing new "
            f"(--idle-timeout; {left:.0f} s left)"
        )

    # -- listing ------------------------------------------------------------------------------------------------

    def _listing_due(self, now: float) -> bool:
        """List again: the last listing is old enough, or (without a watch) the last listed checkpoint went since,
        and one more look catches checkpoints written meanwhile before the sweep ends."""
        assert self._listed_at is not None
        if now - self._listed_at >= max(RELIST_SECONDS, 10 * self._listing_seconds):
            return True
        return not self._settings.watch and self._emptied_at is not None and self._listed_at < self._emptied_at

    def _relist(self, now: float) -> None:
        started = self._clock()
        listed = self._list()
        self._listed_at = now
        self._store_unanswered = False
        for item in listed:
            key = item.key
            if item.final:
                self._final = key
            if key in self._pending or key in self._taken:
                continue
            if key in self._done:
                changed = self._changed(item)
                if changed is None:
                    continue
                item = changed
            self._pending[key] = _Pending(item, now)
            self._emptied_at = None
        # The change checks of done checkpoints count too (a stored one costs a request): the next listing waits ten
        # times as long as this one took, so listing never takes more than a tenth of a watch's time.
        self._listing_seconds = self._clock() - started

    def _changed(self, item: Checkpoint) -> Optional[Checkpoint]:
        """A done checkpoint whose content changed since (its signature differs): to evaluate again."""
        line = self._done[item.key]
        signature, adapter = line.get("signature"), line.get("adapter")
        if signature is None or adapter is None:
            return None  # failed, or done by a version that recorded no signature
        path = item.real or item.path
        stored = is_storage_url(path)
        if stored and self._store_unanswered:
            return None
        now_signature = content_signature(path, self._storage_options)
        if now_signature is None and stored:
            # The store did not answer within its deadline: the other checks of this listing would wait as long
            # each, so they wait for the next listing (a watch's) or run (the change is then noticed).
            self._store_unanswered = True
            logger.warning(
                "could not look at %s in the store to see whether it changed since it was evaluated; "
                "the other stored checkpoints are looked at by the next listing",
                printable(path),
            )
        if now_signature is None or now_signature == signature:
            return None
        return dataclasses.replace(item, replaces=adapter)

    # -- handing out --------------------------------------------------------------------------------------------

    def _take(self, now: float) -> Optional[Checkpoint]:
        """The next checkpoint ready (or given up on) among those listed, listing again first when a listing is due."""
        if self._listed_at is None:
            self._relist(now)
        item = self._next(now)
        if item is None and self._listing_due(now):
            self._relist(now)
            item = self._next(now)
        return item

    def _next(self, now: float) -> Optional[Checkpoint]:
        """The first pending checkpoint that is ready, or the first one due to be given up on."""
        for key, pending in self._pending.items():  # returns right after changing it
            checkpoint = pending.checkpoint
            if checkpoint.problem is None and self._ready(pending, now):
                checkpoint = dataclasses.replace(checkpoint, signature=pending.fingerprint[2])
            elif checkpoint.problem is None:
                error = self._given_up(pending, now)
                if error is None:
                    continue
                checkpoint = dataclasses.replace(checkpoint, problem=error)
            return self._hand_out(key, checkpoint, now)
        return None

    def _hand_out(self, key: str, item: Checkpoint, now: float) -> Checkpoint:
        del self._pending[key]
        self._taken.add(key)
        self._last_news = now
        if not self._pending:
            self._emptied_at = now
        return item

    def _ready(self, pending: _Pending, now: float) -> bool:
        """True when the checkpoint is ready; else remember what it looks like now."""
        checkpoint = pending.checkpoint
        try:
            fingerprint: Fingerprint = checkpoint_fingerprint(
                checkpoint.key, self._storage_options, before=pending.fingerprint
            )
        except FileNotFoundError:
            fingerprint = _ABSENT
        except OSError as error:  # unreadable (permissions), a loop of links: not there, for all we can read
            fingerprint = (0.0, f"it cannot be read ({type(error).__name__}: {error})", None)
        if pending.fingerprint != fingerprint:
            pending.fingerprint, pending.since = fingerprint, now
        return fingerprint[2] is not None and fingerprint[1] is None and self._settled(pending, now)

    def _settled(self, pending: _Pending, now: float) -> bool:
        """Unchanged for ``settle`` seconds, as we watched it or by its modification time (not absent: the callers')."""
        settle = self._settings.settle
        return now - pending.since >= settle or time.time() - pending.fingerprint[0] >= settle

    def _final_done(self) -> bool:
        return self._final is not None and self._final in self._done

    def _given_up(self, pending: _Pending, now: float) -> Optional[LoraSamplerError]:
        """The error a checkpoint that is not ready is given up on with now, or None while it is worth waiting for."""
        (_, problem, signature), settings = pending.fingerprint, self._settings
        shown, waited = printable(pending.checkpoint.path), now - pending.first_seen
        if waited >= settings.checkpoint_timeout:
            why = f"waited {waited:.0f} s (--checkpoint-timeout {settings.checkpoint_timeout:g})"
        elif not settings.watch and signature is None:
            why = "not waited for without --watch"
        elif not settings.watch and problem is not None and self._settled(pending, now):
            # does not read to its end, and is not being written: waiting will not help
            return IncompleteCheckpointError(f"{shown} is incomplete: {problem}", path=pending.checkpoint.path)
        elif self._final_done():
            why = "the run's final checkpoint is done"
        else:
            return None
        if signature is None:
            detail = "" if problem is None else f" ({problem})"
            return CheckpointMissingError(
                f"{shown} does not exist{detail} ({why}): a manifest line ahead of its file, or a checkpoint deleted "
                "after it was listed (a retention policy?). Restore it and run again, or drop its line",
                path=pending.checkpoint.path,
            )
        state = f"does not read to its end: {problem}" if problem else "kept changing"
        return CheckpointIncompleteError(
            f"{shown} {state}; {why}. Raise --checkpoint-timeout for checkpoints that take longer to write",
            path=pending.checkpoint.path,
        )
