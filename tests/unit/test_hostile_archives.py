"""Issue 23's tar header bombs: a PAX or GNU long-name header claiming ~1 GiB is refused before it is read whole.

Archives are built in ``tmp_path``: a real header block followed by only a little of its claimed payload, or a
gzip stream whose header payload really is 64 MiB of zeros (about 64 KiB compressed).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any, List

import pytest

from lora_sampler._adapters.extract import PublishLimits, extract_archive
from lora_sampler.doctor import check_adapter
from lora_sampler.errors import PublishError, UnsafeArchiveError
from lora_sampler.publish import publish_checkpoint

GIB = 1 << 30


def header_block(kind: bytes, size: int) -> bytes:
    """One 512-byte tar header of type ``kind`` (PAX ``x``/``g`` or GNU ``L``/``K``) declaring ``size`` bytes."""
    info = tarfile.TarInfo("././@PaxHeader" if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE) else "././@LongLink")
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.GNU_FORMAT if kind in (tarfile.GNUTYPE_LONGNAME, b"K") else tarfile.USTAR_FORMAT)


def adapter_tar(**names: bytes) -> bytes:
    """A plain tar holding the given files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in names.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK])
def test_archives_metadata_header_claiming_a_gib_is_refused_by_its_block(tmp_path: Path, kind: bytes) -> None:
    """A metadata header declaring 1 GiB is refused naming its kind, its size and max_header_bytes."""
    archive = tmp_path / "bomb.tar"
    archive.write_bytes(header_block(kind, GIB) + b"\0" * 4096)  # the claim, and only 4 KiB of it
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(UnsafeArchiveError, match=rf"declares {GIB} bytes, more than max_header_bytes=1048576"):
        extract_archive(str(archive), str(dest))


def test_archives_header_bomb_in_gzip_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    """A gzip archive whose PAX header really holds 64 MiB is refused while memory stays far below that."""
    payload = 64 << 20
    archive = tmp_path / "bomb.tar.gz"
    with gzip.open(archive, "wb", compresslevel=1) as out:
        out.write(header_block(tarfile.XHDTYPE, payload))
        zeros = b"\0" * (1 << 20)
        for _ in range(payload >> 20):
            out.write(zeros)
    dest = tmp_path / "out"
    dest.mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeArchiveError, match="PAX extended header"):
            extract_archive(str(archive), str(dest))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # tarfile read the 64 MiB header whole before


def test_archives_long_names_and_pax_attributes_still_extract(tmp_path: Path) -> None:
    """A genuine PAX header (a 400-byte name) is under the bound and extracts as before."""
    long_name = "d/" + "n" * 200 + "/" + "m" * 200 + ".bin"
    archive = tmp_path / "ok.tar"
    archive.write_bytes(adapter_tar(**{"adapter_config.json": b"{}", long_name: b"weights"}))
    dest = tmp_path / "out"
    dest.mkdir()
    extract_archive(str(archive), str(dest), limits=PublishLimits(max_name_bytes=1024))
    assert (dest / long_name).read_bytes() == b"weights"


def test_archives_max_header_bytes_is_a_bound_like_the_others(tmp_path: Path) -> None:
    """``PublishLimits(max_header_bytes=...)`` is validated, and raising it lets a larger genuine header through."""
    with pytest.raises(ValueError, match="max_header_bytes"):
        PublishLimits(max_header_bytes=0)
    archive = tmp_path / "big-header.tar"
    archive.write_bytes(header_block(tarfile.XHDTYPE, 2 << 20) + b"\0" * 4096)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(PublishError, match="corrupted or truncated") as info:
        extract_archive(str(archive), str(dest), limits=PublishLimits(max_header_bytes=4 << 20))
    assert not isinstance(info.value, UnsafeArchiveError)  # past the bound's check: tarfile finds it truncated


HOSTILE = ["a link", "a PAX header bomb", "a config of 2 MiB", "a config of 2 MiB, then a link"]


@pytest.mark.parametrize("hostile", [*HOSTILE, "a folder's config of 2 MiB", "a folder's config linked to a device"])
def test_doctor_refuses_a_checkpoint_as_publish_does(tmp_path: Path, hostile: str) -> None:
    """``doctor --adapter`` reads a checkpoint's config through publishing's reader and bounds: a member, a header or
    a config that publishing refuses is a problem with publishing's message, never "ok" (nor read whole)."""
    config = json.dumps({"peft_type": "LORA", "base_model_name_or_path": "m"}).encode()
    config += b" " * (2 << 20) if "config" in hostile else b""  # valid JSON, far beyond any real config's few KiB
    checkpoint = tmp_path / ("folder" if "folder" in hostile else "ckpt.tar")
    if "folder" in hostile:
        checkpoint.mkdir()
        if "device" in hostile:  # a FIFO would hang a reader; publishing refuses either before reading
            (checkpoint / "adapter_config.json").symlink_to(os.devnull)
        else:
            (checkpoint / "adapter_config.json").write_bytes(config)
    else:
        with tarfile.open(checkpoint, "w", format=tarfile.PAX_FORMAT) as tar:
            member = tarfile.TarInfo("adapter_config.json")
            member.size = len(config)
            member.pax_headers = {"comment": "x" * (2 << 20)} if "PAX" in hostile else {}
            tar.addfile(member, io.BytesIO(config))
            link = tarfile.TarInfo("adapter_model.safetensors")
            link.type, link.linkname = (tarfile.SYMTYPE, "/etc/passwd") if "link" in hostile else (tarfile.REGTYPE, "")
            tar.addfile(link, io.BytesIO(b""))
    (tmp_path / "loras").mkdir()
    with pytest.raises(PublishError) as refused:
        publish_checkpoint(checkpoint, tmp_path / "loras")
    finding = check_adapter(str(checkpoint), None, "m")
    assert not finding.ok, finding.detail
    # the same message; a config's names the file where each read it (publish: its temporary folder)
    assert finding.detail.endswith(str(refused.value).split("adapter_config.json")[-1]), (finding.detail, refused)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_doctor_refuses_a_named_pipe_as_publish_does(tmp_path: Path) -> None:
    """``doctor --adapter`` on a pipe named like an archive says what publishing says, from ``stat`` (was: it opened
    the pipe and waited for a writer for ever). Run in a thread, so a regression fails after 10 s."""
    pipe = tmp_path / "ckpt.tar.gz"
    os.mkfifo(pipe)
    (tmp_path / "loras").mkdir()
    with pytest.raises(PublishError) as refused:
        publish_checkpoint(pipe, tmp_path / "loras")
    findings: List[Any] = []
    worker = threading.Thread(target=lambda: findings.append(check_adapter(str(pipe), None, "m")), daemon=True)
    worker.start()
    worker.join(10)
    assert findings and not findings[0].ok and findings[0].detail == str(refused.value)
