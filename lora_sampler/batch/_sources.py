"""Where a sweep's checkpoints come from, and when one may be taken.

Owns pattern expansion in natural order (``step-200`` before ``step-1000``), the training run's manifest
(``checkpoints.jsonl``), the settle/complete probe of one checkpoint, and ``CheckpointSource``, which turns them into
checkpoints ready to evaluate, each once. Storage URLs (patterns, manifest paths, a manifest itself) are listed,
fingerprinted and read through the storage layer.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import posixpath
import re
import struct
import tarfile
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from lora_sampler._adapters import storage
from lora_sampler._defaults import DEFAULT_IDLE_TIMEOUT, DEFAULT_SETTLE
from lora_sampler.errors import BatchInputError, PublishError
from lora_sampler.types import ARCHIVE_SUFFIXES, is_storage_url

logger = logging.getLogger(__name__)

_GLOB_CHARS = re.compile(r"[*?\[]")
_DIGITS = re.compile(r"(\d+)")
_CONFIG_NAME = "adapter_config.json"
_READ_CHUNK = 1 << 20


def natural_key(text: str) -> Tuple[Union[str, int], ...]:
    """Return the sort key in which runs of digits compare as numbers (``step-200`` < ``step-1000``)."""
    parts = _DIGITS.split(text)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def step_of(path: str) -> Optional[int]:
    """Return the training step a checkpoint's name carries: its last run of digits (None without one)."""
    name = os.path.basename(path.rstrip("/"))
    for suffix in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    runs = _DIGITS.findall(name)
    return int(runs[-1]) if runs else None


def _is_checkpoint(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES) or os.path.isdir(path)


def expand_pattern(pattern: str, storage_options: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Return the checkpoints (archives or adapter folders) a path or glob names now, in natural order.

    A plain path that does not exist (yet) gives an empty list, so a watch can wait for it. ``**`` matches folders
    recursively. Local paths come back absolute. A storage URL's pattern globs the store's listing (archive objects
    and prefixes), with ``storage_options``.
    """
    if is_storage_url(pattern):
        return sorted(set(storage.expand(pattern, storage_options)), key=natural_key)
    local = os.path.expanduser(pattern)
    if _GLOB_CHARS.search(local):
        matches = glob.glob(local, recursive=True)
    else:
        matches = [local] if os.path.exists(local) else []
    found = {os.path.abspath(match) for match in matches if _is_checkpoint(match)}
    return sorted(found, key=natural_key)


# -- the settle/complete probe -----------------------------------------------------------------------------------

_VERDICTS: Dict[Tuple[str, Tuple[Any, ...]], Optional[str]] = {}  # (path, signature) -> why it does not read


def checkpoint_fingerprint(path: str, storage_options: Optional[Mapping[str, Any]] = None) -> Tuple[Any, ...]:
    """Return ``(newest modification time, problem, *signature)`` of a checkpoint, for the settle rule.

    ``newest modification time`` is in seconds since the epoch (a folder: its newest file); ``problem`` is None when
    the checkpoint reads to its end (an archive: every member's data and the compression's end; a folder:
    adapter_config.json parses and every safetensors file holds the bytes its header declares), else why it does
    not; the signature (sizes, times, inodes) changes whenever the checkpoint does. The read to the end runs once
    per signature, so probing a settled checkpoint again costs one ``stat`` per file. A storage URL costs one
    metadata request (a listing for a prefix): an object is written whole, so it always reads to its end, and a store
    that refuses or cannot be reached is its problem (retried at the next look).

    Raises:
        FileNotFoundError: nothing is at ``path`` (yet).
    """
    if is_storage_url(path):
        return _stored_fingerprint(path, storage_options)
    info = os.stat(path)
    if os.path.isdir(path):
        files = _folder_files(path)
        newest = max([info.st_mtime] + [mtime for _, _, mtime, _ in files])
        signature: Tuple[Any, ...] = ("folder", info.st_mtime_ns, tuple(files))
    else:
        newest = info.st_mtime
        signature = ("file", info.st_size, info.st_mtime_ns, info.st_ino)
    key = (path, signature)
    if key not in _VERDICTS:
        if len(_VERDICTS) > 4096:  # one entry per checkpoint version seen: bounded for week-long watches
            _VERDICTS.clear()
        _VERDICTS[key] = _folder_problem(path) if signature[0] == "folder" else _archive_problem(path)
    return (newest, _VERDICTS[key], *signature)


def _stored_fingerprint(url: str, storage_options: Optional[Mapping[str, Any]]) -> Tuple[Any, ...]:
    try:
        newest, problem, signature = storage.settle_signature(url, storage_options)
    except PublishError as error:
        return (0.0, str(error), "unreachable")
    return (newest, problem, *signature)


def _folder_files(root: str) -> List[Tuple[str, int, float, int]]:
    """Return ``(relative path, size, mtime, mtime_ns)`` of every file under ``root``, sorted."""
    files = []
    for folder, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder, name)
            try:
                st = os.stat(full)
            except FileNotFoundError:
                continue  # removed while we looked: the next probe sees the change
            files.append((os.path.relpath(full, root), st.st_size, st.st_mtime, st.st_mtime_ns))
    return sorted(files)


def _archive_problem(path: str) -> Optional[str]:
    """Return why an archive does not read to its end (truncated, corrupted), or None when it does."""
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                source = tar.extractfile(member) if member.isfile() else None
                if source is not None:
                    while source.read(_READ_CHUNK):
                        pass
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        return f"it does not read to its end ({type(error).__name__}: {error})"
    return None


def _folder_problem(path: str) -> Optional[str]:
    """Return why an adapter folder is not complete yet, or None when it is."""
    try:
        with open(os.path.join(path, _CONFIG_NAME), "rb") as handle:
            json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        return f"its {_CONFIG_NAME} is missing or does not parse ({type(error).__name__})"
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(os.path.join(path, name))
            if problem is not None:
                return f"{name}: {problem}"
    return None


def _safetensors_problem(path: str) -> Optional[str]:
    """Return why a safetensors file is shorter or longer than its header declares, or None."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            (length,) = struct.unpack("<Q", handle.read(8)) if size >= 8 else (size + 1,)
            if 8 + length > size:
                return f"{size} bytes, shorter than its header"
            header = json.loads(handle.read(length).decode("utf-8"))
    except (OSError, ValueError, struct.error) as error:
        return f"unreadable header ({type(error).__name__})"
    ends = [
        entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__" and "data_offsets" in entry
    ]
    expected = 8 + length + max(ends, default=0)
    return None if size == expected else f"{size} bytes, its header declares {expected}"


# -- the manifest ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a training run.

    Attributes:
        path: The archive or folder (absolute) or storage URL: the ``checkpoint`` of its ``sweep.jsonl`` line.
        step: The training step (the manifest's ``batch``/``step``, else the last number in the name), or None.
        name: The manifest's ``name``, or None.
        final: The manifest marks it as the run's last checkpoint.
    """

    path: str
    step: Optional[int] = None
    name: Optional[str] = None
    final: bool = False


@dataclass(frozen=True)
class Manifest:
    """A training run's ``checkpoints.jsonl``, as ``SamplerClient.sweep``'s ``checkpoints`` (re-read on a watch)."""

    path: str


def read_manifest(path: str, storage_options: Optional[Mapping[str, Any]] = None) -> List[Checkpoint]:
    """Read a ``checkpoints.jsonl`` in file order: ``{"name", "sampler_path" (or "path"), "batch" (or "step"),
    "final"}`` per line; other fields are ignored, a line without a sampler path (a state-only save) is skipped,
    and a relative path resolves against the manifest's folder. A last line still being written is left for later.
    The manifest may itself be a storage URL (then a relative path is a key beside it).

    Raises:
        BatchInputError: a complete line is not a JSON object (the message names the line).
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
            raise BatchInputError(
                f"{path}: line {number} is not JSON; the manifest takes one JSON object a line, as "
                '{"name": ..., "sampler_path": ..., "batch": ...}',
                path=path,
                line_number=number,
            ) from None
        checkpoint = _manifest_entry(entry, folder, path, number)
        if checkpoint is not None:
            checkpoints.append(checkpoint)
    return checkpoints


def _manifest_entry(entry: Any, folder: str, path: str, number: int) -> Optional[Checkpoint]:
    if not isinstance(entry, dict):
        raise BatchInputError(f"{path}: line {number} is not a JSON object", path=path, line_number=number)
    location = entry.get("sampler_path") or entry.get("path")
    if not location:
        return None  # a state-only save: nothing to sample
    if not isinstance(location, str):
        raise BatchInputError(f"{path}: line {number}: sampler_path must be a string", path=path, line_number=number)
    if "://" in location:
        pass  # a storage URL, or a training service's own (tinker://), kept as written
    elif is_storage_url(folder):
        location = f"{folder}/{posixpath.normpath(location)}"
    else:
        location = os.path.abspath(os.path.join(folder, os.path.expanduser(location)))
    step = entry.get("batch", entry.get("step"))
    name = entry.get("name")
    return Checkpoint(
        location,
        step=step if isinstance(step, int) and not isinstance(step, bool) else step_of(location),
        name=name if isinstance(name, str) else None,
        final=entry.get("final") is True,
    )


# -- the source --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unusable:
    """A checkpoint that never became complete: recorded as failed with ``reason``."""

    checkpoint: Checkpoint
    reason: str


Listing = Callable[[], List[Checkpoint]]
_ABSENT: Tuple[Any, ...] = ("absent",)  # the fingerprint of a checkpoint not (yet) there


def listing(
    checkpoints: Union[str, Sequence[str], Manifest], storage_options: Optional[Mapping[str, Any]] = None
) -> Listing:
    """Return the function that lists the checkpoints known now: patterns re-globbed, or the manifest re-read.

    Patterns' matches are merged in natural order; a manifest keeps its file order.
    """
    if isinstance(checkpoints, Manifest):
        manifest = checkpoints.path

        def reread() -> List[Checkpoint]:
            try:
                return read_manifest(manifest, storage_options)
            except FileNotFoundError:  # not written yet: a watch waits for it
                return []

        return reread
    patterns = [checkpoints] if isinstance(checkpoints, str) else list(checkpoints)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError("checkpoints takes a path or glob, a list of them, or a Manifest")

    def expand() -> List[Checkpoint]:
        found: Set[str] = set()
        for pattern in patterns:
            found.update(expand_pattern(pattern, storage_options))
        return [Checkpoint(path, step=step_of(path)) for path in sorted(found, key=natural_key)]

    return expand


class CheckpointSource:
    """Hand out each checkpoint once it is complete, in the listing's order, each once.

    A checkpoint is ready once its fingerprint stayed the same for ``settle`` seconds (or its newest file is older
    than that) and it reads to its end. One still changing, absent, or not reading to its end is waited for while
    watching; without a watch, or once the watch ended, one that never became complete comes out as ``Unusable``.

    Args:
        list_checkpoints: The listing (``listing``).
        skip: Checkpoint paths already done (the ledger's).
        watch: Keep looking for new checkpoints until ``idle_timeout`` passes with nothing new, or the manifest's
            ``final`` checkpoint is ``finished``.
        settle: Seconds a fingerprint must stay the same.
        idle_timeout: Seconds of nothing new after which a watch ends (without a watch: the longest wait for a
            checkpoint that keeps changing).
        storage_options: Passed to ``checkpoint_fingerprint``.
    """

    def __init__(
        self,
        list_checkpoints: Listing,
        *,
        skip: Iterable[str] = (),
        watch: bool = False,
        settle: float = DEFAULT_SETTLE,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        storage_options: Optional[Mapping[str, Any]] = None,
    ):
        self._list, self._watch, self._settle, self._idle = list_checkpoints, watch, settle, idle_timeout
        self._storage_options = storage_options
        self._taken: Set[str] = set(skip)
        self._finished: Set[str] = set(skip)
        self._seen: Dict[str, Tuple[Tuple[Any, ...], float]] = {}  # path -> (fingerprint, since when)
        self._last_news = time.monotonic()
        self._final: Optional[str] = None
        self._pending: List[Checkpoint] = []  # listed, not taken, not ready at the last poll
        #: True once nothing is left to hand out (and, watching, the watch ended).
        self.ended = False
        #: Why it ended, for a person: every checkpoint listed was taken, the watch's idle time ran out, or the
        #: manifest's final checkpoint is done.
        self.end_reason = ""

    def finished(self, path: str) -> None:
        """Record that ``path`` was evaluated (or given up on): a watch counts its idle time from here."""
        self._finished.add(path)
        self._last_news = time.monotonic()

    def poll(self) -> Union[Checkpoint, Unusable, None]:
        """Return the next ready checkpoint, one given up on, or None (nothing ready now; see ``ended``)."""
        if self.ended:
            return None
        now = time.monotonic()
        pending: List[Checkpoint] = []
        for checkpoint in self._list():
            if checkpoint.final:
                self._final = checkpoint.path
            if checkpoint.path in self._taken:
                continue
            if self._ready(checkpoint, now):
                return self._take(checkpoint)
            pending.append(checkpoint)
        final_done = self._final is not None and self._final in self._finished
        self._pending = pending
        if self._watch and not final_done and now - self._last_news < self._idle:
            return None
        if self._watch:
            self.end_reason = (
                f"the manifest's final checkpoint ({self._final}) is done"
                if final_done
                else f"--watch saw nothing new for {self._idle:g} s (--idle-timeout)"
            )
        else:
            self.end_reason = "every checkpoint listed was taken (pass --watch to follow a run still training)"
        return self._give_up(pending, now, watch_ended=self._watch)

    def waiting_for(self) -> str:
        """Say what the source waits for now (after a ``poll`` that returned None), with the bound of the wait."""
        now = time.monotonic()
        changing = [c.path for c in self._pending if self._seen.get(c.path, (_ABSENT, now))[0] != _ABSENT]
        absent = [c.path for c in self._pending if c.path not in changing]
        if changing:
            return f"waiting for {changing[0]} to be complete (still being written; {self._settle:g} s unchanged)"
        if absent and self._watch:
            return f"waiting for {absent[0]}, named but not there yet"
        left = max(0.0, self._idle - (now - self._last_news))
        return (
            f"waiting for a new checkpoint; the watch ends after {self._idle:g} s with nothing new "
            f"(--idle-timeout; {left:.0f} s left)"
        )

    def _ready(self, checkpoint: Checkpoint, now: float) -> bool:
        """True when the checkpoint is ready; else remember what it looks like now."""
        try:
            fingerprint = checkpoint_fingerprint(checkpoint.path, self._storage_options)
        except FileNotFoundError:
            fingerprint = _ABSENT
        previous = self._seen.get(checkpoint.path)
        if previous is None or previous[0] != fingerprint:
            self._seen[checkpoint.path] = (fingerprint, now)
            self._last_news = now  # something new, or something changing: a watch goes on
            since = now
        else:
            since = previous[1]
        return fingerprint[1] is None and self._settled(fingerprint, since, now)

    def _settled(self, fingerprint: Tuple[Any, ...], since: float, now: float) -> bool:
        """Unchanged for ``settle`` seconds, as we watched it or by its modification time (never when absent)."""
        if fingerprint == _ABSENT:
            return False
        return now - since >= self._settle or time.time() - float(fingerprint[0]) >= self._settle

    def _give_up(self, pending: List[Checkpoint], now: float, *, watch_ended: bool) -> Union[Unusable, None]:
        """Without a watch (or once it ended): give up on what cannot become ready; end when nothing is left."""
        for checkpoint in pending:
            fingerprint, since = self._seen[checkpoint.path]
            still_changing = fingerprint != _ABSENT and not self._settled(fingerprint, since, now)
            if still_changing and not watch_ended and now - since < self._idle:
                return None  # being written right now: worth waiting for, even without a watch
            self._taken.add(checkpoint.path)
            if fingerprint == _ABSENT:
                reason = f"{checkpoint.path} does not exist"
            elif fingerprint[1] is not None:
                reason = f"{checkpoint.path} is incomplete: {fingerprint[1]}"
            else:
                reason = f"{checkpoint.path} kept changing for {now - since:.0f} s"
            return Unusable(checkpoint, reason)
        self.ended = True
        return None

    def _take(self, checkpoint: Checkpoint) -> Checkpoint:
        self._taken.add(checkpoint.path)
        self._last_news = time.monotonic()
        return checkpoint
