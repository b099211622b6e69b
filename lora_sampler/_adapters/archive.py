"""Filesystem mechanics of publishing: content digests and signatures, archive member rules, temporary folders.

Never extracts, renames into place or publishes. Archive members are checked by our own rules on every Python
version (``check_member``, ``check_layout``), which refuse everything tarfile's ``data`` filter refuses (and every
link besides), so that filter is not run again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tarfile
import time
from functools import partial
from typing import Dict, Generator, Iterable, List, Optional, Tuple, Union

from lora_sampler.errors import PublishError, UnsafeArchiveError

logger = logging.getLogger(__name__)

#: Bytes read per step when hashing a checkpoint on its own.
CHUNK_SIZE = 1 << 20
#: The file vLLM's resolver reads from each adapter folder.
CONFIG_FILE = "adapter_config.json"
#: Name of the record lora_sampler leaves in each published folder (vLLM ignores extra files).
MARKER_FILE = ".lora_sampler.json"
#: Age after which a temporary folder is treated as a crashed publisher's leftover, whoever made it.
DEFAULT_STALE_AFTER = 3600.0

StrPath = Union[str, "os.PathLike[str]"]
Signature = Tuple[int, int, int, int]
#: A checkpoint file's bytes (a local file, or an object in a store), chunk by chunk, each read when the reader asks
#: for it; closing the generator ends the read (closes the file, or the download).
Chunks = Generator[bytes, None, None]

#: The fix every refusal of a hostile member suggests.
ARCHIVE_FIX = "re-create it from the adapter folder with plain files only, e.g. tar -czf step.tar.gz -C parent step"
# Temporary folders: ".tmp-<name>-<host tag>-<pid>-<random>" while publishing, ".del-..." while removing.
_TEMP_NAME = re.compile(r"^\.(?:tmp|del)-.*-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def checkpoint_digest(path: StrPath) -> str:
    """Return the sha256 (hex) of an archive's bytes, or of a folder's sorted relative paths and contents.

    Reads the whole checkpoint (nothing is cached: publishing finds an unchanged checkpoint by the signature its
    published folder records, without reading it).
    """
    real = os.path.realpath(os.fspath(path))
    return _sha256_folder(list_folder_files(real)) if os.path.isdir(real) else _sha256_file(real)


def file_signature(path: str) -> Signature:
    """Return what tells a file's content changed without reading it: size, mtime_ns, ctime_ns and inode.

    ctime and inode too: a same-size rewrite within a coarse mtime tick still changes one of them.
    """
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def file_chunks(path: str) -> Chunks:
    """Read a local file in ``CHUNK_SIZE`` chunks, opened on the first read and closed with the generator."""
    with open(path, "rb", buffering=0) as f:
        yield from iter(partial(f.read, CHUNK_SIZE), b"")


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def _sha256_folder(files: List[Tuple[str, str]]) -> str:
    digest = hashlib.sha256(b"lora_sampler-folder-v1\0")
    for rel, full in files:
        digest.update(rel.encode("utf-8", "surrogateescape") + b"\0" + str(os.path.getsize(full)).encode() + b"\0")
        for chunk in file_chunks(full):
            digest.update(chunk)
    return digest.hexdigest()


#: The files of an adapter folder that are the adapter: its config and its weights (peft's ``save_pretrained``
#: names; ``new_embeddings`` holds the rows of added tokens). Publishing a folder copies these and nothing else.
ADAPTER_FILE_NAMES = (
    CONFIG_FILE,
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_model.pt",
    "new_embeddings.safetensors",
    "new_embeddings.bin",
)


def list_folder_files(root: str) -> List[Tuple[str, str]]:
    """List a checkpoint folder's adapter files (``ADAPTER_FILE_NAMES`` at its root) as sorted ``(name, full path)``.

    Nothing else the folder holds (optimizer states, logs, a README, other folders) is read, hashed or copied: a
    training run's checkpoint folder can hold gigabytes beside its adapter, or files that are not meant to be shared
    in the resolver folder. Symlinked files count as the file they point to (a Hugging Face cache snapshot is made of
    them).

    Raises:
        PublishError: an adapter file is a device, FIFO or socket, or a dangling link.
    """
    found: List[Tuple[str, str]] = []
    for name in ADAPTER_FILE_NAMES:
        full = os.path.join(root, name)
        if not os.path.lexists(full):
            continue
        try:
            mode = os.stat(full).st_mode
        except OSError as error:
            raise PublishError(f"cannot read {full} ({error}); an adapter folder holds plain files") from error
        if not stat.S_ISREG(mode):
            raise PublishError(f"{full} is not a regular file (device, FIFO or socket); replace it with the file")
        found.append((name, full))
    return sorted(found)


def check_member(member: tarfile.TarInfo, archive: str) -> Optional[str]:
    """Return a member's normalised relative path (None for the archive's root folder), or refuse it.

    The link policy is the simplest safe one: every symbolic and hard link is refused, wherever it points, because
    an adapter is plain files and a link that resolves inside today can be re-pointed by a later member.

    Raises:
        UnsafeArchiveError: naming the member and why.
    """
    parts = [part for part in member.name.split("/") if part not in ("", ".")]
    reason = _path_problem(member.name, parts) or _kind_problem(member)
    if reason is None and not parts and not member.isdir():
        reason = "is a file without a name"
    if reason is not None:
        raise UnsafeArchiveError(f"refusing archive {archive}: member {member.name!r} {reason}; {ARCHIVE_FIX}")
    return "/".join(parts) if parts else None  # None: the archive's root folder


def _path_problem(name: str, parts: List[str]) -> Optional[str]:
    """Say why a member's path could land outside the folder, or None when it cannot."""
    if "\\" in name or "\0" in name:
        return "contains a backslash or NUL, which could escape the folder on some systems"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    if ".." in parts:
        return "has a '..' segment, which points outside the adapter folder"
    return None


def _kind_problem(member: tarfile.TarInfo) -> Optional[str]:
    """Say why a member is not a regular file or a folder, or None when it is one."""
    if member.issym():
        return f"is a symbolic link to {member.linkname!r} (links are not allowed in adapter archives)"
    if member.islnk():
        return f"is a hard link to {member.linkname!r} (links are not allowed in adapter archives)"
    if member.ischr() or member.isblk():
        return "is a device file"
    if member.isfifo():
        return "is a FIFO"
    if not (member.isreg() or member.isdir()):
        return f"has unsupported type {member.type!r}"
    return None


def check_layout(rel: str, member: tarfile.TarInfo, kinds: Dict[str, bool], archive: str) -> None:
    """Refuse duplicate files and paths that use a file as a folder; record the member and its parents."""
    parts = rel.split("/")
    for depth in range(1, len(parts)):
        parent = "/".join(parts[:depth])
        if kinds.setdefault(parent, True) is False:
            raise UnsafeArchiveError(f"refusing archive {archive}: member {member.name!r} is inside file {parent!r}")
    previous = kinds.get(rel)
    if previous is not None and not (previous and member.isdir()):
        raise UnsafeArchiveError(f"refusing archive {archive}: member {member.name!r} appears twice; {ARCHIVE_FIX}")
    kinds[rel] = member.isdir()


def fsync_folders(folders: Iterable[str]) -> None:
    """Flush folder entries to disk so a crash after the rename cannot leave a published folder missing files."""
    if os.name != "posix":  # folders cannot be opened for fsync on Windows
        return
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _host_tag() -> str:
    # A pid is only meaningful on the host (and pid namespace) that owns it: containers sharing a hostname and a
    # mounted folder must not take each other's live pids for dead ones.
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


_HOST_TAG = _host_tag()


def make_temp_folder(base: str, kind: str, name: str) -> str:
    """Create ``<base>/.<kind>-<name>-<host tag>-<pid>-<random>``: dotted, so the resolver never serves it."""
    while True:
        path = os.path.join(base, f".{kind}-{name[:48]}-{_HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)  # 0o777 minus the umask, like the folder a plain extract makes (mkdtemp's 0o700 is not)
            return path
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue


def clean_stale_temporaries(lora_base_dir: StrPath, *, max_age: float = DEFAULT_STALE_AFTER) -> List[str]:
    """Remove temporary folders left by crashed publishers or removers; never one still in use.

    A temporary folder is stale when its process is gone (checked only for folders made on this host and pid
    namespace), or when it is older than ``max_age`` seconds (for any host). Called on every cold publish.

    Returns:
        The folders removed.
    """
    base = os.fspath(lora_base_dir)
    removed: List[str] = []
    now = time.time()
    with os.scandir(base) as entries:
        for entry in entries:
            match = _TEMP_NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            mine = match.group("host") == _HOST_TAG
            if age > max_age or (mine and not _is_pid_alive(int(match.group("pid")))):
                shutil.rmtree(entry.path, ignore_errors=True)
                logger.info("removed stale temporary folder %s (%.0f s old)", entry.path, age)
                removed.append(entry.path)
    return removed


def _is_pid_alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows; age alone decides there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True
