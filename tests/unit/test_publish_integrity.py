"""Publishing only what an archive really holds: linear extraction, verified streams, bounds, full disks, names."""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import io
import json
import lzma
import os
import pathlib
import shutil
import tarfile
from typing import Any, Callable, Dict, List, Tuple

import pytest

from lora_sampler._adapters import archive as _archive
from lora_sampler._adapters import publish
from lora_sampler.cli import main as cli_main
from lora_sampler.errors import PublishError, UnsafeArchiveError
from lora_sampler.names import NAME_RULE, validate_adapter_name
from lora_sampler.publish import MARKER_FILE, PublishLimits, default_adapter_name, publish_checkpoint

CONFIG = {"peft_type": "LORA", "base_model_name_or_path": "/models/tiny-model", "r": 8}
WEIGHTS = "adapter_model.safetensors"


def tar_bytes(files: List[Tuple[str, bytes]], dirs: Tuple[str, ...] = ()) -> bytes:
    """An uncompressed tar holding ``dirs`` (folders) and ``files``, in that order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def adapter_files(weights: bytes = b"weights-1", prefix: str = "") -> List[Tuple[str, bytes]]:
    return [(prefix + "adapter_config.json", json.dumps(CONFIG).encode()), (prefix + WEIGHTS, weights)]


def write(path: pathlib.Path, data: bytes) -> pathlib.Path:
    path.write_bytes(data)
    return path


def assert_nothing_published(base: pathlib.Path) -> None:
    """No adapter and no temporary folder is left in lora_base_dir."""
    assert os.listdir(base) == []


# -- linear extraction ---------------------------------------------------------------------------------------------


def test_publish_zeros_payload_is_not_quadratic(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 MiB of zeros (16 KB of gzip): gzip's reader feeds tarfile each byte once; no buffer is re-sliced per read.

    Handing tarfile the compressed file (``r|*``) made each 64 KiB read copy what was left of a multi-megabyte
    decompressed block: 22 s for 64 MiB. Counted here, not timed: the bytes tarfile's stream buffer carries over
    between reads must stay a small multiple of the payload (quadratic gave ~500x), and the bytes gzip.GzipFile
    hands out are the uncompressed tar, once.
    """
    size = 16 << 20
    archive = write(tmp_path / "zeros.tar.gz", gzip.compress(tar_bytes(adapter_files(bytes(size))), 6))
    assert os.path.getsize(archive) < size // 100
    carried = [0]
    real_read = tarfile._Stream.read  # type: ignore[attr-defined]

    def counting_read(self: Any, size: int) -> bytes:
        carried[0] += len(getattr(self, "buf", b"")) + len(getattr(self, "dbuf", b""))
        return real_read(self, size)  # type: ignore[no-any-return]

    delivered = [0]
    real_gzip_read = gzip.GzipFile.read

    def counting_gzip_read(self: gzip.GzipFile, size: int = -1) -> bytes:
        data = real_gzip_read(self, size)
        delivered[0] += len(data)
        return data

    monkeypatch.setattr(tarfile._Stream, "read", counting_read)  # type: ignore[attr-defined]
    monkeypatch.setattr(gzip.GzipFile, "read", counting_gzip_read)
    adapter = publish_checkpoint(archive, base)
    published = pathlib.Path(str(adapter.path), WEIGHTS)
    assert published.stat().st_size == size
    with open(published, "rb") as f:
        assert not any(chunk.strip(b"\0") for chunk in iter(lambda: f.read(1 << 20), b""))
    assert carried[0] < 4 * size, f"tarfile re-copied {carried[0]} bytes for a {size}-byte payload"
    assert delivered[0] == len(gzip.decompress(archive.read_bytes()))
    assert adapter.digest == hashlib.sha256(archive.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("suffix", "compress"),
    [(".tar.bz2", bz2.compress), (".tar.xz", lzma.compress), (".tar", lambda data: data)],
    ids=["bzip2", "xz", "plain"],
)
def test_publish_other_compressions(
    tmp_path: pathlib.Path, base: pathlib.Path, suffix: str, compress: Callable[[bytes], bytes]
) -> None:
    """bzip2, xz and plain tar archives publish like gzip ones (the decompressor is picked by magic bytes)."""
    archive = write(tmp_path / f"step{suffix}", compress(tar_bytes(adapter_files(b"w" * 300_000))))
    adapter = publish_checkpoint(archive, base)
    assert pathlib.Path(str(adapter.path), WEIGHTS).read_bytes() == b"w" * 300_000
    assert adapter.name.startswith("step-")


def test_publish_concatenated_gzip_members(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A gzip file of several members (``cat a.gz b.gz``) is one stream, as gzip -d reads it."""
    weights = os.urandom(100_000)
    data = tar_bytes(adapter_files(weights))
    archive = write(tmp_path / "two.tar.gz", gzip.compress(data[:7000]) + gzip.compress(data[7000:]))
    adapter = publish_checkpoint(archive, base)
    assert pathlib.Path(str(adapter.path), WEIGHTS).read_bytes() == weights


# -- corrupted and truncated archives ------------------------------------------------------------------------------


def stored_gzip_with_flipped_weight_byte(tmp_path: pathlib.Path) -> pathlib.Path:
    """A level-0 (stored blocks) .tar.gz whose weights have one flipped byte: tar reads it, gzip -t says crc error."""
    weights = b"\x11" * 200_000
    data = bytearray(gzip.compress(tar_bytes(adapter_files(weights)), compresslevel=0))
    at = data.find(weights[:4096]) + 100_000
    data[at] ^= 0x01
    return write(tmp_path / "flipped.tar.gz", bytes(data))


def test_publish_gzip_crc_error_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A flipped data byte in a stored-block gzip is a PublishError naming the archive; nothing is published."""
    archive = stored_gzip_with_flipped_weight_byte(tmp_path)
    with tarfile.open(archive, "r:gz") as check:  # the tar layer alone sees nothing wrong
        assert check.getnames() == ["adapter_config.json", WEIGHTS]
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(archive, base)
    message = str(caught.value)
    assert str(archive) in message and "CRC" in message and "nothing was published" in message
    assert_nothing_published(base)


@pytest.mark.parametrize("cut", [8, 4, 1], ids=["trailer", "length", "last byte"])
def test_publish_cut_gzip_trailer_is_refused(tmp_path: pathlib.Path, base: pathlib.Path, cut: int) -> None:
    """A .tar.gz missing (part of) its 8-byte CRC/length trailer is refused: the tar inside is whole, the file not."""
    data = gzip.compress(tar_bytes(adapter_files(os.urandom(50_000))))
    archive = write(tmp_path / "cut.tar.gz", data[:-cut])
    with pytest.raises(PublishError, match="truncated") as caught:
        publish_checkpoint(archive, base)
    assert str(archive) in str(caught.value)
    assert_nothing_published(base)


def test_publish_gzip_trailing_garbage_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """Bytes after the gzip stream that are not another gzip member are refused (gzip -t refuses them too)."""
    archive = write(tmp_path / "tail.tar.gz", gzip.compress(tar_bytes(adapter_files())) + b"garbage!")
    with pytest.raises(PublishError, match="cannot read"):
        publish_checkpoint(archive, base)
    assert_nothing_published(base)


@pytest.mark.parametrize("compress", [bz2.compress, lzma.compress], ids=["bzip2", "xz"])
def test_publish_corrupted_bz2_xz_is_refused(
    tmp_path: pathlib.Path, base: pathlib.Path, compress: Callable[[bytes], bytes]
) -> None:
    """bzip2 and xz archives are verified too: a flipped byte or a cut end is a PublishError."""
    data = bytearray(compress(tar_bytes(adapter_files(os.urandom(50_000)))))
    cut = write(tmp_path / "cut.tar", bytes(data[:-5]))
    with pytest.raises(PublishError, match="cannot read"):
        publish_checkpoint(cut, base)
    data[len(data) // 2] ^= 0x40
    flipped = write(tmp_path / "flipped.tar", bytes(data))
    with pytest.raises(PublishError, match="cannot read"):
        publish_checkpoint(flipped, base)
    assert_nothing_published(base)


def test_publish_plain_tar_cut_at_a_member_boundary_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A plain .tar cut right after a member (no end-of-archive marker) is refused, not published without the rest."""
    files = [*adapter_files(b"w" * 1024), ("tokenizer.json", b"{}" * 300)]
    data = tar_bytes(files)
    end = data.index(b"tokenizer.json")  # the third member's header starts with its name
    archive = write(tmp_path / "cut.tar", data[:end])
    with pytest.raises(PublishError, match="truncated"):
        publish_checkpoint(archive, base)
    assert_nothing_published(base)


def test_publish_damaged_member_header_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A damaged header mid-archive (tarfile silently ends its listing there) is refused, not a partial publish."""
    files = [*adapter_files(b"w" * 1024), ("tokenizer.json", b"{}" * 300)]
    data = bytearray(tar_bytes(files))
    header = data.index(b"tokenizer.json")
    data[header + 148 : header + 156] = b"9999999\0"  # a wrong header checksum
    archive = write(tmp_path / "damaged.tar", bytes(data))
    with pytest.raises(PublishError, match="damaged or truncated member header"):
        publish_checkpoint(archive, base)
    assert_nothing_published(base)


# -- bounds, free space, a full disk -------------------------------------------------------------------------------


def test_publish_limits_default_fits_lora_adapters() -> None:
    """The defaults: 16 GiB extracted, 10,000 members, 1024-byte paths; bad bounds are refused."""
    assert PublishLimits() == PublishLimits(max_total_bytes=16 << 30, max_members=10_000, max_name_bytes=1024)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_members"):
            PublishLimits(max_members=bad)  # type: ignore[arg-type]


def test_publish_member_path_over_max_name_bytes(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A member path longer than max_name_bytes is refused naming the bound and how to raise it."""
    deep = "/".join(["d" * 50] * 30) + "/x.bin"
    archive = write(tmp_path / "deep.tar", tar_bytes([*adapter_files(), (deep, b"x")]))
    with pytest.raises(UnsafeArchiveError) as caught:
        publish_checkpoint(archive, base)
    message = str(caught.value)
    assert "max_name_bytes=1024" in message and "PublishLimits(max_name_bytes=...)" in message
    assert_nothing_published(base)
    assert publish_checkpoint(archive, base, limits=PublishLimits(max_name_bytes=4096)).path


def test_publish_name_component_over_255_bytes(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A member name over 255 bytes is a PublishError naming it (it was a raw OSError [Errno 36])."""
    long_name = "é" * 130  # 260 bytes of UTF-8
    archive = write(tmp_path / "long.tar.gz", gzip.compress(tar_bytes([*adapter_files(), (long_name, b"x")])))
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(archive, base)
    assert not isinstance(caught.value, OSError)
    assert "260 bytes" in str(caught.value) and "rename that file" in str(caught.value)
    assert_nothing_published(base)


def test_publish_marker_folder_member_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A ``.lora_sampler.json`` folder member is a PublishError (it was an IsADirectoryError)."""
    for prefix in ("", "step/"):
        archive = write(tmp_path / "marker.tar", tar_bytes(adapter_files(prefix=prefix), dirs=(prefix + MARKER_FILE,)))
        with pytest.raises(UnsafeArchiveError, match=f"a folder named {MARKER_FILE}"):
            publish_checkpoint(archive, base)
        assert_nothing_published(base)


def test_publish_checks_free_space_before_writing(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too little free space for a member is refused before it is written, naming the folder, needed and free."""
    archive = write(tmp_path / "big.tar.gz", gzip.compress(tar_bytes(adapter_files(bytes(300_000)))))
    real_usage = shutil.disk_usage

    def small_disk(path: Any) -> Any:
        return real_usage(path)._replace(free=100_000)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(archive, base)
    message = str(caught.value)
    assert f"not enough free space in {base}" in message
    assert f"'{WEIGHTS}' needs 300000 bytes" in message and "100000 bytes are free" in message
    assert_nothing_published(base)


@pytest.mark.parametrize("checkpoint_kind", ["archive", "folder"])
def test_publish_disk_full_names_folder_and_sizes(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch, checkpoint_kind: str
) -> None:
    """ENOSPC mid-write is a PublishError naming the folder, the bytes needed and free; no temporary is left."""
    weights = os.urandom(3 << 20)
    if checkpoint_kind == "archive":
        checkpoint = write(tmp_path / "step.tar.gz", gzip.compress(tar_bytes(adapter_files(weights)), 1))
    else:
        checkpoint = tmp_path / "step"
        checkpoint.mkdir()
        for name, data in adapter_files(weights):
            (checkpoint / name).write_bytes(data)
    real_write = os.write
    written: Dict[str, int] = {"bytes": 0}

    def write_until_full(fd: int, data: Any) -> int:
        if written["bytes"] > (1 << 20):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count = real_write(fd, data)
        written["bytes"] += count
        return count

    monkeypatch.setattr(os, "write", write_until_full)
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(checkpoint, base)
    monkeypatch.undo()
    message = str(caught.value)
    assert f"no space left in {base}" in message
    assert f"writing '{WEIGHTS}' ({len(weights)} bytes) needs at least" in message
    assert "bytes are free" in message and "Nothing was published" in message
    assert not isinstance(caught.value, OSError)
    assert_nothing_published(base)


def test_publish_folder_over_max_total_bytes(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A folder checkpoint is bounded too, before anything is copied."""
    folder = tmp_path / "step"
    folder.mkdir()
    for name, data in adapter_files(bytes(5000)):
        (folder / name).write_bytes(data)
    with pytest.raises(UnsafeArchiveError, match=f"largest: '{WEIGHTS}'.*max_total_bytes=1000"):
        publish_checkpoint(folder, base, limits=PublishLimits(max_total_bytes=1000))
    assert_nothing_published(base)


def test_publish_limits_reach_the_client(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """SamplerClient(publish_limits=...) bounds its publishes (no request is sent before the refusal)."""
    from lora_sampler import SamplerClient

    archive = write(tmp_path / "step.tar.gz", gzip.compress(tar_bytes(adapter_files(bytes(5000)))))
    limits = PublishLimits(max_total_bytes=1000)
    with SamplerClient("http://127.0.0.1:9", lora_base_dir=base, publish_limits=limits) as client:
        with pytest.raises(UnsafeArchiveError, match="max_total_bytes=1000"):
            client.publish(archive)
    assert_nothing_published(base)


# -- names ---------------------------------------------------------------------------------------------------------

HOSTILE_FILE_NAMES = [
    "my model (v2).tar.gz",
    ".tar.gz",
    "..tgz",
    "....tar",
    "-.tar",
    "step.tar.tar.gz",
    "x.tgz.tgz",
    "\u202egpj.tar.gz",
    "new\nline.tar.gz",
    "ünïcode-名前.tgz",
    "é" * 120 + ".tar.gz",
    "a" * 250 + ".tar",
    "tab\tand space.tar.xz",
    "$(rm -rf).tbz2",
    "CON.tar",
]


@pytest.mark.parametrize("filename", HOSTILE_FILE_NAMES)
def test_derived_names_follow_the_name_rule(tmp_path: pathlib.Path, base: pathlib.Path, filename: str) -> None:
    """Every content-derived name passes validate_adapter_name, however hostile the file name; and it publishes."""
    archive = write(tmp_path / filename, gzip.compress(tar_bytes(adapter_files())))
    name = default_adapter_name(archive)
    assert validate_adapter_name(name) == name
    assert publish_checkpoint(archive, base).name == name
    folder = tmp_path / ("dir-" + filename.replace(".", "_"))[:200]
    folder.mkdir()
    for member, data in adapter_files():
        (folder / member).write_bytes(data)
    assert validate_adapter_name(default_adapter_name(folder))


def test_derived_name_of_undecodable_file_name(tmp_path: pathlib.Path) -> None:
    """A file name that is not UTF-8 (a surrogate-escaped byte) still gives a valid name."""
    raw = os.path.join(os.fsencode(tmp_path), b"bad\xff.tar.gz")
    with open(raw, "wb") as f:
        f.write(gzip.compress(tar_bytes(adapter_files())))
    name = default_adapter_name(os.fsdecode(raw))
    assert validate_adapter_name(name) == name


@pytest.mark.parametrize("bad", ["../evil", "step.tar.gz", ".hidden", "x" * 201, "naïve"])
def test_cli_publish_name_follows_the_rule(
    tmp_path: pathlib.Path, base: pathlib.Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lora-sampler publish --name`` refuses what the rule refuses, stating the rule, before touching any file."""
    archive = write(tmp_path / "step.tar.gz", gzip.compress(tar_bytes(adapter_files())))
    argv = ["publish", str(archive), "--name", bad, "--lora-base-dir", str(base), "--base-url", "http://127.0.0.1:9"]
    assert cli_main(argv) == 2
    assert NAME_RULE in capsys.readouterr().err
    assert_nothing_published(base)


def test_publish_in_a_new_process_reads_nothing_of_what_is_there(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process finds an unchanged archive's published folder by the signature its record holds: nothing is
    hashed or extracted (this test's process stands in: publishing keeps nothing in memory); a cold one is extracted
    and hashed in one pass (read once)."""
    archive = write(tmp_path / "step.tar.gz", gzip.compress(tar_bytes(adapter_files())))
    hashed: List[str] = []
    real_hash = _archive._sha256_file
    monkeypatch.setattr(_archive, "_sha256_file", lambda path: hashed.append(path) or real_hash(path))
    first = publish_checkpoint(archive, base)
    assert hashed == []  # hashed while extracted

    def no_extract(*args: object, **kwargs: object) -> str:
        raise AssertionError("extracted again")

    monkeypatch.setattr(publish, "extract_archive", no_extract)
    assert publish_checkpoint(archive, base) == first
    assert hashed == []


def test_cli_max_adapter_gib_bounds_what_publish_extracts(
    tmp_path: pathlib.Path, base: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-adapter-gib`` reaches the publish bound: a checkpoint over it is refused, naming the flag."""
    archive = write(tmp_path / "step.tar.gz", gzip.compress(tar_bytes(adapter_files(weights=bytes(2 << 20)))))
    argv = ["publish", str(archive), "--lora-base-dir", str(base), "--base-url", "http://127.0.0.1:9"]
    assert cli_main([*argv, "--max-adapter-gib", "0.001"]) != 0
    err = capsys.readouterr().err
    assert "max_total_bytes" in err and "--max-adapter-gib" in err
    assert_nothing_published(base)
    assert cli_main([*argv, "--max-adapter-gib", "0"]) == 2
    assert "--max-adapter-gib: takes a number of GiB > 0" in capsys.readouterr().err
