"""One pass from a checkpoint to files on the target filesystem: hashing, decompression, bounds, verification.

``extract_archive`` reads an archive (a file, or an object's chunks from storage) once, front to back: it hashes
the raw bytes, decompresses them with the standard library's buffered readers, lets tarfile read the uncompressed
stream, writes each checked member, and reads to the end so the compressed stream's own checks run. ``copy_files``
copies a folder checkpoint's files, each taken as a member: one loop checks (``_checked``) and writes
(``_write_members``) both. Both stay inside the folder they are handed and raise ``PublishError`` for what goes wrong
on either side (a corrupted archive, a bound, a full disk).
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import io
import lzma
import os
import queue
import shutil
import tarfile
import threading
import zlib
from contextlib import closing, suppress
from dataclasses import dataclass
from functools import partial
from typing import IO, Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple, cast

from lora_sampler._adapters.archive import (
    ARCHIVE_FIX,
    MARKER_FILE,
    Chunks,
    check_layout,
    check_member,
    file_chunks,
    fsync_folders,
)
from lora_sampler.errors import PublishError, UnsafeArchiveError
from lora_sampler.types import check_count

#: Bytes per step when extracting or copying: measured faster than 64 KiB and 1 MiB on a 64 MiB payload.
COPY_CHUNK_SIZE = 1 << 18
#: Chunks handed to the hashing thread and not hashed yet, at most: the source's own chunks (4 MiB of a file's or
#: S3's 1 MiB chunks, 64 MiB of another store's 16 MiB ranges).
HASH_QUEUE_CHUNKS = 4
#: Most bytes of zero padding read after a tar end-of-archive marker (tar's largest blocking factor is 1 MiB).
MAX_TAR_PADDING = 16 << 20
#: Longest file name component when the filesystem does not say (``NAME_MAX`` on Linux and macOS).
DEFAULT_NAME_MAX = 255
#: Checked members of a checkpoint, in its order: (relative path, member, size, its data's chunks).
Members = Iterator[Tuple[str, tarfile.TarInfo, int, Chunks]]
#: Tar header types whose payload tarfile reads whole before the member it describes, by their type flag.
_META_TYPES = {
    tarfile.XHDTYPE: "PAX extended",
    tarfile.XGLTYPE: "PAX global",
    tarfile.GNUTYPE_LONGNAME: "GNU long-name",
    tarfile.GNUTYPE_LONGLINK: "GNU long-link",
}


@dataclass(frozen=True)
class PublishLimits:
    """Bounds on what one publish may write into the shared adapter folder (a small archive can expand hugely).

    Every refusal is an ``UnsafeArchiveError`` naming the bound, the member and this class.

    Attributes:
        max_total_bytes: Most bytes the checkpoint's files may add up to once extracted. Default 16 GiB: a LoRA
            of a 70B model (Llama-3-70B, all seven linear modules of 80 layers) holds about 13 M parameters per
            unit of rank, so rank 256 is 6.6 GB in bf16 (13 GB in fp32), rank 64 is 1.7 GB; saved embeddings
            (``modules_to_save``) add about 4 GB. Anything larger is not an adapter, or is a bomb.
        max_members: Most archive members (files and folders); an adapter holds a handful. Default 10,000.
        max_name_bytes: Longest member path below the adapter folder, in UTF-8 bytes. Default 1024. Each path
            component must also fit the filesystem's own limit (255 bytes on common ones), which no bound raises.
        max_header_bytes: Largest tar metadata header (a PAX extended header, a GNU long name or long link),
            checked from its 512-byte header block before tarfile reads it whole. Default 1 MiB: such a header
            holds a name and a few attributes, a few KiB at most.
    """

    max_total_bytes: int = 16 << 30
    max_members: int = 10_000
    max_name_bytes: int = 1024
    max_header_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for bound in ("max_total_bytes", "max_members", "max_name_bytes", "max_header_bytes"):
            check_count(f"PublishLimits({bound}=...)", getattr(self, bound), 1)


#: The bounds every publish uses unless told otherwise.
DEFAULT_LIMITS = PublishLimits()

# Read side only: write errors become PublishError before they get here (PublishError is no OSError).
_READ_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FADV_DONTNEED: Optional[int] = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None
_O_BINARY = getattr(os, "O_BINARY", 0)


def copy_files(
    source: str,
    files: Sequence[Tuple[str, int, Chunks]],
    dest: str,
    *,
    limits: PublishLimits = DEFAULT_LIMITS,
    durable: bool = True,
) -> None:
    """Copy ``(relative path, size, chunks)`` files into the existing, empty folder ``dest``, as plain files.

    Each file is a member like an archive's, held to the same rules (object keys in storage may hold ``..`` or
    absolute parts) and bounds and written by the same loop. The paths and sizes are known up front, so every path,
    ``limits.max_total_bytes`` and the free space of ``dest``'s filesystem are checked before the first byte is read.

    Raises:
        UnsafeArchiveError: a path is hostile, or the files exceed one of ``limits``.
        PublishError: there is not enough free space, or a file cannot be read or written.
    """
    total = sum(size for _, size, _ in files)
    if total > limits.max_total_bytes:
        rel, size, _ = max(files, key=lambda file: file[1])
        raise UnsafeArchiveError(
            f"refusing checkpoint {source}: its files add up to {total} bytes (largest: {rel!r}, "
            f"{size} bytes), more than max_total_bytes={limits.max_total_bytes}; " + _raise_hint("max_total_bytes")
        )
    writer = _Writer(source, dest, durable)
    members = [(tarfile.TarInfo(rel), size, chunks) for rel, size, chunks in files]
    checked = list(_checked(members, source, limits, writer.name_max))  # every path before any byte
    writer.check_free_space(total, files[0][0] if files else "")
    _write_members(iter(checked), writer)
    writer.finish()


def _checked(
    members: Iterable[Tuple[tarfile.TarInfo, int, Chunks]], source: str, limits: PublishLimits, name_max: int
) -> Members:
    """Hold each member (of an archive, or a folder's file) to the member count, the members' rules, its name to the
    bounds and the filesystem, the layout so far and the total size; yield it with its relative path (the archive's
    root left out).
    """
    kinds: Dict[str, bool] = {}  # relative path -> is a folder
    total = 0
    for count, (member, size, chunks) in enumerate(members, 1):
        if count > limits.max_members:
            raise UnsafeArchiveError(
                f"refusing archive {source}: more than max_members={limits.max_members} members (member "
                f"{member.name!r}); an adapter checkpoint holds a handful of files. " + _raise_hint("max_members")
            )
        rel = check_member(member, source)
        if rel is not None:
            _check_name(rel, member, source, limits, name_max)
            check_layout(rel, member, kinds, source)
            total += 0 if member.isdir() else size
            if total > limits.max_total_bytes:
                raise UnsafeArchiveError(
                    f"refusing archive {source}: member {member.name!r} ({size} bytes) brings the "
                    f"extracted size past max_total_bytes={limits.max_total_bytes}; " + _raise_hint("max_total_bytes")
                )
            yield rel, member, size, chunks


def extract_archive(
    archive: str,
    dest: str,
    *,
    limits: PublishLimits = DEFAULT_LIMITS,
    durable: bool = True,
    chunks: Optional[Chunks] = None,
) -> str:
    """Extract a tar archive (plain, gzip, bzip2 or xz) into the existing, empty folder ``dest``; return its sha256.

    ``read_archive`` reads it and checks each member; each is written as it is read. Files are created with
    ``O_EXCL | O_NOFOLLOW``, and since no link is ever created, nothing can be written outside ``dest``. A refusal
    mid-archive leaves partial files in ``dest``, which the caller removes.

    Args:
        archive: The archive file (or, with ``chunks``, its URL, named in errors).
        dest: An existing, empty folder on the target filesystem.
        limits: Bounds on the total size, the member count and the member name length.
        durable: fsync every file and folder written.
        chunks: As ``read_archive``'s.

    Raises:
        UnsafeArchiveError: a member is hostile, or the archive exceeds one of ``limits``.
        PublishError: the file is not a readable tar archive, is corrupted or truncated, or the disk is full.
    """
    writer = _Writer(archive, dest, durable)
    write = partial(_write_members, writer=writer)
    digest = read_archive(archive, write, limits=limits, name_max=writer.name_max, chunks=chunks)
    writer.finish()
    return digest


def read_archive(
    archive: str,
    consume: Callable[[Members], None],
    *,
    limits: PublishLimits = DEFAULT_LIMITS,
    name_max: int = DEFAULT_NAME_MAX,
    chunks: Optional[Chunks] = None,
) -> str:
    """Read a tar archive (plain, gzip, bzip2 or xz) once, handing its checked members to ``consume``; return its
    sha256.

    One front-to-back pass over the file: its raw bytes are hashed as they are read (the digest returned is
    ``checkpoint_digest`` of the archive), the standard library's buffered decompressor (``gzip``/``bz2``/``lzma``)
    unpacks them, and tarfile reads the *uncompressed* stream, in ``r:`` mode, which only ever seeks it forward.
    Handing tarfile the compressed file instead (``r|*``) re-slices its decompression buffer on every read, which is
    quadratic when a block expands to megabytes (a 64 MiB file of zeros took 22 s instead of 0.3 s). The stream is
    read to its very end, so the gzip CRC and length (bzip2's and xz's checks alike) are verified, and whatever
    follows the tar end-of-archive marker must be zero padding: a damaged member header would otherwise end the
    archive early and silently drop what follows.

    Each member is checked before ``consume`` sees it (``_checked``): only regular files and folders with relative
    paths and no ``..`` are accepted; every link, device and FIFO is refused, as are duplicates, and ``limits`` hold.
    ``consume`` reads a member's chunks, or not, before it takes the next member. Publishing extracts what it is
    handed; ``doctor --adapter`` reads the config alone, so it refuses what publishing refuses.

    Args:
        archive: The archive file (or, with ``chunks``, its URL, named in errors).
        consume: Called once with the checked members, in the archive's order.
        limits: Bounds on the total size, the member count, the member name length and the metadata headers.
        name_max: Longest file name component the target filesystem takes.
        chunks: The archive's bytes to read instead of the file (an object in storage), read once front to back:
            no local copy of the archive is made. Closed here, read to the end or not.

    Raises:
        UnsafeArchiveError: a member is hostile, or the archive exceeds one of ``limits``.
        PublishError: the file is not a readable tar archive, or is corrupted or truncated.
    """
    try:
        with _HashingReader(file_chunks(archive) if chunks is None else chunks) as raw:
            compressed = io.BufferedReader(raw, buffer_size=COPY_CHUNK_SIZE)
            stream = _TarStream(_decompressor(compressed), archive, limits.max_header_bytes)
            with tarfile.open(fileobj=cast(IO[bytes], stream), mode="r:") as tar:
                consume(_checked(_tar_members(tar, archive), archive, limits, name_max))
                end = tar.offset  # where the end-of-archive marker (or a damaged header) starts
            stream.finish(end, archive)  # the gzip CRC and length, bzip2's and xz's checks are verified here
            while compressed.read(COPY_CHUNK_SIZE):  # bytes after the last compressed stream (bz2/xz ignore them)
                pass
            return raw.hexdigest()
    except _READ_ERRORS as error:
        raise PublishError(
            f"cannot read {archive}: it is corrupted or truncated, or not a tar archive ({type(error).__name__}: "
            f"{error}); nothing was published. Check it (gzip -t / tar -tf), copy it again, or pass the adapter "
            "folder itself"
        ) from error


def _tar_members(tar: tarfile.TarFile, archive: str) -> Iterator[Tuple[tarfile.TarInfo, int, Chunks]]:
    """Each member of ``tar`` with its size and its data's chunks (read, if at all, before the next member is)."""
    for member in tar:
        yield member, member.size, _member_chunks(tar, member, archive)


def _member_chunks(tar: tarfile.TarFile, member: tarfile.TarInfo, archive: str) -> Chunks:
    src = tar.extractfile(member)
    if src is None:  # pragma: no cover - check_member admits only regular files and folders
        raise UnsafeArchiveError(f"refusing archive {archive}: member {member.name!r} has no data")
    with src:
        yield from iter(partial(src.read, COPY_CHUNK_SIZE), b"")


def _write_members(members: Members, writer: _Writer) -> None:
    """Write checked members into the writer's folder: folders, and regular files within the free space."""
    for rel, member, size, chunks in members:
        if member.isdir():
            writer.make_folder(rel)
            continue
        writer.check_free_space(size, member.name)
        with closing(chunks):
            writer.write_file(rel, chunks, size)


class _HashingReader(io.RawIOBase):
    """A raw reader of a checkpoint's chunks that hashes every byte it hands out, in a thread of its own (sha256
    releases the GIL).

    The archive is read once, for the digest and the data; hashing beside the decompression keeps an
    incompressible archive's publish near the cost of the extraction alone. A chunk is read only when the reader
    needs one (no reading ahead). Call ``hexdigest`` after the last read, and ``close`` in any case (it stops the
    thread and closes the chunks: a download ends there).
    """

    def __init__(self, chunks: Chunks) -> None:
        super().__init__()
        self._chunks = chunks
        self._pending = memoryview(b"")
        self._sha256 = hashlib.sha256()
        self._to_hash: queue.Queue[Optional[bytes]] = queue.Queue(maxsize=HASH_QUEUE_CHUNKS)
        self._thread = threading.Thread(target=self._hash_chunks, name="lora_sampler-sha256", daemon=True)
        self._thread.start()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._pending:
            chunk = next(self._chunks, b"")
            if chunk:
                self._to_hash.put(chunk)
            self._pending = memoryview(chunk)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _hash_chunks(self) -> None:
        for chunk in iter(self._to_hash.get, None):
            self._sha256.update(chunk)

    def hexdigest(self) -> str:
        """Return the sha256 of every byte read so far; no read may follow."""
        self.close()
        return self._sha256.hexdigest()

    def close(self) -> None:
        self._chunks.close()
        if self._thread.is_alive():
            self._to_hash.put(None)
            self._thread.join()
        super().close()


def _decompressor(compressed: io.BufferedReader[_HashingReader]) -> IO[bytes]:
    """Return a reader of the decompressed stream, chosen by the file's magic bytes (a plain tar is its own)."""
    magic = compressed.peek(6)[:6]
    if magic.startswith(b"\x1f\x8b"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=compressed, mode="rb"))
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(compressed)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(compressed)
    return compressed


def _header_number(field: bytes) -> int:
    """Read a number field of a tar header: octal, or GNU's base-256 (first byte 0x80) for large sizes."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def _checksums(block: bytes) -> Tuple[int, int]:
    """Return the unsigned and signed sums of a header block, its checksum field counted as spaces (as tar does)."""
    rest = block[:148] + b" " * 8 + block[156:]
    return sum(rest), sum(byte - 256 if byte > 127 else byte for byte in rest)


class _TarStream:
    """The uncompressed tar stream, as a file tarfile can only seek forward in (``r:`` mode without re-reads).

    tarfile reads headers and member data straight from it (no ``_Stream`` buffer in between). A backward seek
    would re-read the archive, so it is refused (tarfile makes none while iterating). It remembers the last block
    read, to tell an end-of-archive marker from a damaged header after tarfile stops.
    """

    def __init__(self, source: IO[bytes], archive: str = "", max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes):
        self._source = source
        self._archive, self._max_header_bytes = archive, max_header_bytes
        self.position = 0
        self.last_read = b""

    def read(self, size: int = -1) -> bytes:
        if size > self._max_header_bytes or size < 0:
            self._check_header_payload(size)
        data = self._source.read(size)
        self.position += len(data)
        self.last_read = data
        return data

    def tell(self) -> int:
        return self.position

    def _check_header_payload(self, size: int) -> None:
        """Refuse to read a metadata header's payload whole when its header block declares it over the bound.

        tarfile reads a PAX or GNU long-name header's payload in one ``read`` right after its 512-byte block; the
        block is checked here first (its type, its checksum, then its size field), so a 1 GiB claim costs no memory.
        """
        block = self.last_read
        if len(block) != tarfile.BLOCKSIZE or block[156:157] not in _META_TYPES:
            return
        try:
            declared, stored = _header_number(block[124:136]), _header_number(block[148:156])
        except ValueError:
            return  # not a header: tarfile reports it
        if stored in _checksums(block) and declared > self._max_header_bytes:
            raise UnsafeArchiveError(
                f"refusing archive {self._archive}: a tar {_META_TYPES[block[156:157]]} header at byte "
                f"{self.position - tarfile.BLOCKSIZE} declares {declared} bytes, more than max_header_bytes="
                f"{self._max_header_bytes} (a header bomb: tarfile would read it whole into memory). "
                + _raise_hint("max_header_bytes")
            )

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset + (self.position if whence == io.SEEK_CUR else 0)
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.position:
            raise io.UnsupportedOperation("the tar stream is read once, front to back")
        while self.position < target:
            if not self.read(min(COPY_CHUNK_SIZE, target - self.position)):
                break
        return self.position

    def finish(self, end: int, archive: str) -> None:
        """Read to the end (the decompressor checks its CRC and length there); refuse anything but zero padding.

        Args:
            end: Where tarfile stopped: the offset of the block it took for the end-of-archive marker.
            archive: The archive's path, for errors.
        """
        ended_cleanly = self.position == end + tarfile.BLOCKSIZE and not self.last_read.strip(b"\0")
        padding_end = self.position + MAX_TAR_PADDING
        nonzero = False
        for chunk in iter(partial(self.read, COPY_CHUNK_SIZE), b""):
            nonzero = nonzero or bool(chunk.strip(b"\0"))
            if self.position > padding_end:
                raise PublishError(
                    f"cannot read {archive}: the tar stream goes on for more than {MAX_TAR_PADDING} bytes after its "
                    "end-of-archive marker; nothing was published. Create the archive again with tar"
                )
        if self.position < end + tarfile.BLOCKSIZE:
            raise PublishError(
                f"cannot read {archive}: the tar stream ends at byte {self.position} without its end-of-archive "
                "marker (the archive is truncated); nothing was published. Copy or create it again"
            )
        if not ended_cleanly or nonzero:
            raise PublishError(
                f"cannot read {archive}: the tar stream holds data after byte {end}, where tarfile stopped (a damaged "
                "or truncated member header); nothing was published. Check it with tar -tvf, or create it again"
            )


class _Writer:
    """Writes a checkpoint's files below ``dest``: folders, exclusive plain files, disk-space errors, fsyncs."""

    def __init__(self, source: str, dest: str, durable: bool) -> None:
        self.source = source
        self.dest = dest
        self.folder = os.path.dirname(dest)  # lora_base_dir: what the user knows and can free space in
        self.durable = durable
        self.total = 0
        self.made = {dest}
        try:
            self.name_max = os.pathconf(dest, "PC_NAME_MAX")
        except (AttributeError, OSError, ValueError):  # Windows, or a filesystem that does not say
            self.name_max = DEFAULT_NAME_MAX

    def make_folder(self, rel: str) -> None:
        self._make_folder(os.path.join(self.dest, *rel.split("/")))

    def _make_folder(self, folder: str) -> None:
        if folder in self.made:
            return
        # Only folders we created exist under dest (never links), so makedirs cannot be led outside it.
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise self._write_error(error, folder, 0) from error
        while folder not in self.made:
            self.made.add(folder)
            folder = os.path.dirname(folder)

    def check_free_space(self, size: int, member: str) -> None:
        """Refuse to start writing ``size`` bytes that cannot fit (sizes are known before each file is written)."""
        if size <= 0:
            return
        free = _free_bytes(self.dest)
        if free is not None and size > free:
            raise PublishError(
                f"not enough free space in {self.folder} to publish {self.source}: {member!r} needs {size} bytes "
                f"({self.total + size} bytes in all so far), {free} bytes are free. Free space there, or publish "
                "into a folder on a larger filesystem"
            )

    def write_file(self, rel: str, chunks: Iterable[bytes], size: int) -> None:
        target = os.path.join(self.dest, *rel.split("/"))
        self._make_folder(os.path.dirname(target))
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY, 0o666)
        except OSError as error:
            raise self._write_error(error, rel, size) from error
        try:
            written = 0
            # Read errors are the archive's (corruption, truncation): they are not caught here.
            for chunk in chunks:
                try:
                    _write_all(fd, chunk)
                except OSError as error:
                    raise self._write_error(error, rel, size) from error
                if self.durable:
                    _start_writeback(fd, written, len(chunk))
                written += len(chunk)
                self.total += len(chunk)
            if self.durable:
                try:
                    os.fsync(fd)
                except OSError as error:
                    raise self._write_error(error, rel, size) from error
        finally:
            os.close(fd)

    def _write_error(self, error: OSError, what: str, size: int) -> PublishError:
        if error.errno in _NO_SPACE:
            free = _free_bytes(self.dest)
            return PublishError(
                f"no space left in {self.folder} while publishing {self.source}: writing {what!r} ({size} bytes) "
                f"needs at least {self.total + size} bytes in all, {'an unknown number of' if free is None else free} "
                f"bytes are free ({error.strerror}). Nothing was published; free space there, or publish into a "
                "folder on a larger filesystem"
            )
        if error.errno == errno.ENAMETOOLONG:
            return PublishError(
                f"cannot publish {self.source}: the filesystem of {self.folder} refuses the name {what!r} as too long "
                f"({error.strerror}); rename that file in the checkpoint"
            )
        return PublishError(f"cannot write {what!r} of {self.source} into {self.folder}: {error}")

    def finish(self) -> None:
        if self.durable:
            fsync_folders(self.made)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a just-written range to disk now, so the final fsync has little left to wait.

    On Linux ``POSIX_FADV_DONTNEED`` starts asynchronous writeback of dirty pages (like ``sync_file_range``, which
    Python does not expose) and keeps dirty pages and pages under writeback in the cache (a page whose writeback
    already finished may leave it). Elsewhere it does nothing useful, and is harmless: the fsync still makes the
    file durable.
    """
    if _FADV_DONTNEED is not None:
        with suppress(OSError):  # a filesystem without fadvise
            os.posix_fadvise(fd, offset, length, _FADV_DONTNEED)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _free_bytes(folder: str) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:  # pragma: no cover - a filesystem without statvfs
        return None


def _raise_hint(bound: str) -> str:
    flag = " (the CLI: --max-adapter-gib)" if bound == "max_total_bytes" else ""
    return (
        f"If the checkpoint is genuine, raise the bound: publish_checkpoint(..., limits=PublishLimits({bound}=...)), "
        f"or SamplerClient(..., publish_limits=PublishLimits({bound}=...)){flag}"
    )


def _shortened(name: str) -> str:
    return name if len(name) <= 200 else f"{name[:100]}...{name[-100:]}"


def _check_name(rel: str, member: tarfile.TarInfo, archive: str, limits: PublishLimits, name_max: int) -> None:
    """Refuse member paths the bound or the filesystem cannot take, and a folder where our record file goes."""
    encoded = rel.encode("utf-8", "surrogateescape")
    if len(encoded) > limits.max_name_bytes:
        raise UnsafeArchiveError(
            f"refusing archive {archive}: member {_shortened(member.name)!r} has a path of {len(encoded)} bytes, "
            f"more than max_name_bytes={limits.max_name_bytes}. " + _raise_hint("max_name_bytes")
        )
    for part in rel.split("/"):
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > name_max:
            raise UnsafeArchiveError(
                f"refusing archive {archive}: member {_shortened(member.name)!r} has a name component of {size} bytes, "
                f"and the filesystem allows {name_max} (no argument can raise that); rename that file in the checkpoint"
            )
    parts = rel.split("/")
    if member.isdir() and parts[-1] == MARKER_FILE and len(parts) <= 2:
        raise UnsafeArchiveError(
            f"refusing archive {archive}: member {member.name!r} is a folder named {MARKER_FILE}, the file where "
            f"lora_sampler records what it published; remove it from the archive. {ARCHIVE_FIX}"
        )
