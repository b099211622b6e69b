"""``sweep.jsonl``: one line per finished checkpoint, appended atomically, so a kill loses nothing and repeats nothing.

Owns reading the ledger on resume (finished checkpoints; failed ones dropped so they run again; a torn last line
repaired), the lock that keeps a second sweep out of the same folder, and the durable append. No HTTP, no threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Dict, List

from lora_sampler._files import json_object_line, replacing
from lora_sampler.batch._lines import one_writer, to_json_line
from lora_sampler.errors import OutputWriteError

logger = logging.getLogger(__name__)

#: The ledger's file name in the output folder.
LEDGER_NAME = "sweep.jsonl"


class Ledger:
    """The ledger of one output folder, held open for appending while a sweep runs (use it as a context manager).

    Opening it takes the ledger's one-writer lock (``one_writer``: a second sweep into the folder is refused), reads
    the finished checkpoints, and rewrites the file atomically without the lines that must go: error lines (those
    checkpoints run again), a torn last line (a kill mid-write), and repeats of one checkpoint with the same adapter
    (the latest line is kept, in the older one's place unless the checkpoint's content changed between; a checkpoint
    evaluated again in a run is deduplicated so at once, keeping this run's error lines). A checkpoint whose content
    changed has one line per content (adapter); ``finished`` holds the latest. Each ``append`` is one ``write`` of one
    whole line, then ``fsync``.

    Args:
        output_dir: The sweep's output folder (created when missing).
        restart: Forget every checkpoint the ledger holds (emptied under the ledger's lock): each runs again.

    Raises:
        LoraSamplerError: another sweep holds the folder.
    """

    def __init__(self, output_dir: str, *, restart: bool = False):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LEDGER_NAME)
        self._lock = contextlib.ExitStack()
        refusal = f"another sweep is writing to {output_dir}; wait for it to end, or pass another --output-dir"
        self._lock.enter_context(one_writer(self.path, refusal=refusal, unlocked="one sweep per folder is up to you"))
        self._fd = -1
        try:
            #: The finished checkpoints' latest lines, by ``ledger_key``, in file order.
            self.finished: Dict[str, Dict[str, Any]] = {}
            #: The lines the file keeps, in file order, by ``(ledger_key, adapter)`` (an error line of this run: alone).
            self._kept: Dict[Any, bytes] = {}
            if restart and os.path.exists(self.path):
                _replace(self.path, [])
            self._load()
        except BaseException:
            self._lock.close()
            raise

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file and release the ledger's one-writer lock. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self._lock.close()

    def append(self, entry: Dict[str, Any]) -> None:
        """Append one line durably (one ``write``, then ``fsync``); a finished one joins ``finished``.

        Raises:
            OutputWriteError: the line cannot be written (a full disk; the sweep says how to resume); a part written
                is cut off again, so the ledger stays whole lines.
        """
        data = (to_json_line(entry) + "\n").encode("utf-8")
        view = memoryview(data)
        size = os.fstat(self._fd).st_size
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise self._unwritable(error) from None
        if "error" in entry:
            self._kept[object()] = data  # failed in this run: it stays for the sweep's summary
        elif self._keep(data, entry):  # evaluated again: its content changed, or a touched file gave the same adapter
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
                _replace(self.path, list(self._kept.values()))  # the lines as held: the file is not read again
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except OSError as error:  # the line is written; its older twin goes at the next opening
                raise self._unwritable(error) from None

    def _unwritable(self, error: OSError) -> OutputWriteError:
        return OutputWriteError(f"cannot write {self.path}", path=self.path, reason=error.strerror or str(error))

    def _load(self) -> None:
        """Read the finished lines and open the ledger for appending; first rewrite it atomically without the lines
        that must go: error lines and a torn one (they run again), and repeats (``_keep``)."""
        dropped = 0
        with open(self.path, "a+b") as handle:  # created when missing
            handle.seek(0)
            for raw in handle:
                entry = json_object_line(raw)
                if entry is None or not isinstance(entry.get("checkpoint"), str) or "error" in entry:
                    dropped += 1  # torn, or failed: it runs again
                else:
                    dropped += self._keep(raw, entry)
        if dropped:
            _replace(self.path, list(self._kept.values()))
            logger.info("%s: %d lines kept, %d dropped", self.path, len(self._kept), dropped)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _keep(self, raw: bytes, entry: Dict[str, Any]) -> bool:
        """Keep a finished line as its checkpoint's latest; return whether it replaces an older line of the same
        checkpoint and adapter (then kept in the older one's place, unless another adapter's line of the checkpoint
        came between: then last, as its latest evaluation)."""
        key = (ledger_key(entry), entry.get("adapter"))
        again = key in self._kept
        if again and self.finished[key[0]].get("adapter") != key[1]:  # content A, then B, then A again
            del self._kept[key]
        self._kept[key] = raw
        self.finished[key[0]] = entry  # the latest evaluation of a checkpoint whose content changed
        return again


def ledger_key(entry: Dict[str, Any]) -> str:
    """What identifies a ledger line's checkpoint, as a listing keys it: its real path (``path``), else (older
    ledgers, which name no ``path``) its ``checkpoint`` with symlinks resolved (a URL as it is)."""
    path = entry.get("path")
    if isinstance(path, str):
        return path
    checkpoint = str(entry["checkpoint"])
    return checkpoint if "://" in checkpoint else os.path.realpath(checkpoint)


def read_ledger(path: str) -> List[Dict[str, Any]]:
    """Return every whole line of a ledger, in file order (for the summary and the plot); [] when there is none."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as handle:
        return [entry for entry in map(json_object_line, handle) if entry is not None]


def _replace(path: str, lines: List[bytes]) -> None:
    """Replace ``path`` with ``lines``, whole or not at all."""
    with replacing(path) as out:
        out.writelines(lines)
