"""Publishing checkpoints: hostile archives, layouts, content-derived names, the digest cache, the preflight."""

from __future__ import annotations

import inspect
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from typing import Callable, Dict, Generator, List, Optional, Tuple

import pytest

from lora_sampler._adapters import archive as _archive
from lora_sampler._adapters import extract, publish
from lora_sampler.errors import AdapterConfigError, PublishError, UnsafeArchiveError
from lora_sampler.names import NAME_RULE
from lora_sampler.publish import (
    MARKER_FILE,
    PublishLimits,
    check_adapter_config,
    clean_stale_temporaries,
    default_adapter_name,
    publish_checkpoint,
    remove_adapter_dir,
    validate_adapter_name,
)

ENGINE_MODEL = "/models/tiny-model"
CONFIG = {"peft_type": "LORA", "base_model_name_or_path": ENGINE_MODEL, "r": 8}
Member = Tuple[tarfile.TarInfo, Optional[bytes]]


def file_member(name: str, data: bytes) -> Member:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    return info, data


def special_member(name: str, kind: bytes, linkname: str = "") -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def adapter_members(
    prefix: str = "", weights: bytes = b"weights-1", config: Optional[Dict[str, object]] = None
) -> List[Member]:
    config_bytes = json.dumps(config or CONFIG).encode()
    return [
        file_member(prefix + "adapter_config.json", config_bytes),
        file_member(prefix + "adapter_model.safetensors", weights),
    ]


def write_archive(path: pathlib.Path, members: List[Member], mode: str = "w:gz") -> pathlib.Path:
    with tarfile.open(path, "w:gz" if mode == "w:gz" else "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def write_adapter_dir(path: pathlib.Path, weights: bytes = b"weights-1") -> pathlib.Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(CONFIG))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def snapshot(root: pathlib.Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_published(adapter_path: Optional[str], weights: bytes = b"weights-1") -> None:
    assert adapter_path is not None
    folder = pathlib.Path(adapter_path)
    assert json.loads((folder / "adapter_config.json").read_text()) == CONFIG
    assert (folder / "adapter_model.safetensors").read_bytes() == weights
    assert sorted(os.listdir(folder)) == [MARKER_FILE, "adapter_config.json", "adapter_model.safetensors"]


# -- hostile archives ----------------------------------------------------------------------------------------------


def hostile_cases(tmp_path: pathlib.Path) -> Dict[str, Tuple[List[Member], str]]:
    """Each case: extra members appended to a valid adapter, and the member name the error must cite."""
    outside = str(tmp_path / "outside.txt")
    return {
        "absolute path": ([file_member(outside, b"pwned")], outside),
        "dotdot": ([file_member("../../outside.txt", b"pwned")], "../../outside.txt"),
        "dotdot inside a folder": ([file_member("step/../../../outside.txt", b"pwned")], "step/../../../outside.txt"),
        "symlink out": (
            [special_member("escape", tarfile.SYMTYPE, str(tmp_path)), file_member("escape/outside.txt", b"pwned")],
            "escape",
        ),
        "relative symlink out": ([special_member("up", tarfile.SYMTYPE, "../../..")], "up"),
        "symlink inside": ([special_member("alias", tarfile.SYMTYPE, "adapter_model.safetensors")], "alias"),
        "hardlink out": ([special_member("hard", tarfile.LNKTYPE, "../../secret.txt")], "hard"),
        "absolute hardlink": ([special_member("hard", tarfile.LNKTYPE, str(tmp_path / "secret.txt"))], "hard"),
        "char device": ([special_member("null", tarfile.CHRTYPE)], "null"),
        "block device": ([special_member("disk", tarfile.BLKTYPE)], "disk"),
        "fifo": ([special_member("pipe", tarfile.FIFOTYPE)], "pipe"),
        "backslash": ([file_member("..\\..\\outside.txt", b"pwned")], "..\\..\\outside.txt"),
    }


HOSTILE_KINDS = list(hostile_cases(pathlib.Path("/x")))


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_publish_hostile_member_is_refused_naming_it(tmp_path: pathlib.Path, base: pathlib.Path, kind: str) -> None:
    """A hostile member is refused with UnsafeArchiveError naming it, and nothing is written anywhere."""
    (tmp_path / "secret.txt").write_text("secret")
    extra, member_name = hostile_cases(tmp_path)[kind]
    archive = write_archive(tmp_path / "evil.tar.gz", adapter_members() + extra)
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError) as caught:
        publish_checkpoint(archive, base)
    assert f"member {member_name!r}" in str(caught.value)
    assert snapshot(tmp_path) == before
    assert os.listdir(base) == []
    assert (tmp_path / "secret.txt").read_text() == "secret"


def test_publish_member_checks_refuse_all_the_stdlib_filter_refuses(tmp_path: pathlib.Path) -> None:
    """Our own checks refuse every hostile member, each one tarfile's data filter refuses (where it exists) among
    them, on every Python: so publishing does not run that filter as a second check."""
    for extra, member_name in hostile_cases(tmp_path).values():
        (info,) = [info for info, _ in extra if info.name == member_name]
        with pytest.raises(UnsafeArchiveError) as caught:
            _archive.check_member(info, "evil.tar")
        assert f"refusing archive evil.tar: member {member_name!r}" in str(caught.value)


@pytest.mark.parametrize("link_type", [tarfile.SYMTYPE, tarfile.LNKTYPE], ids=["symlink", "hardlink"])
def test_publish_link_pointing_inside_the_adapter_folder_is_refused_as_a_link(
    tmp_path: pathlib.Path, base: pathlib.Path, link_type: bytes
) -> None:
    """A link to a file inside the adapter folder is refused for being a link (tarfile's data filter allows it)."""
    target = "adapter_model.safetensors"  # a file of the same archive, in the same folder
    members = [*adapter_members(), special_member("alias", link_type, target)]
    archive = write_archive(tmp_path / "inside.tar.gz", members)
    kind = "symbolic" if link_type == tarfile.SYMTYPE else "hard"
    with pytest.raises(UnsafeArchiveError, match=f"member 'alias' is a {kind} link to {target!r}"):
        publish_checkpoint(archive, base)
    assert os.listdir(base) == []


@pytest.mark.parametrize(
    "extra",
    [
        [file_member("adapter_model.safetensors", b"again")],
        [file_member("sub", b"x"), file_member("sub/inner.bin", b"y")],
    ],
    ids=["duplicate", "file used as folder"],
)
def test_publish_ambiguous_layout_is_refused(tmp_path: pathlib.Path, base: pathlib.Path, extra: List[Member]) -> None:
    """Duplicate members and members inside a file are refused, not silently overwritten."""
    archive = write_archive(tmp_path / "odd.tar", adapter_members() + extra, mode="w")
    with pytest.raises(UnsafeArchiveError, match=r"appears twice|inside file"):
        publish_checkpoint(archive, base)
    assert os.listdir(base) == []


def test_publish_member_count_cap(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """An archive with more members than max_members is refused, naming the bound, the member and how to raise it."""
    members = adapter_members() + [file_member(f"extra-{i}.txt", b"x") for i in range(5)]
    archive = write_archive(tmp_path / "many.tgz", members)
    with pytest.raises(UnsafeArchiveError) as caught:
        publish_checkpoint(archive, base, limits=PublishLimits(max_members=3))
    message = str(caught.value)
    assert "more than max_members=3 members (member 'extra-1.txt')" in message
    assert "PublishLimits(max_members=...)" in message and "publish_limits=" in message
    assert os.listdir(base) == []


def test_publish_total_size_cap(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """An archive whose members add up to more than max_total_bytes (a gzip bomb) is refused before writing it."""
    archive = write_archive(tmp_path / "bomb.tgz", adapter_members(weights=bytes(100_000)))
    with pytest.raises(UnsafeArchiveError) as caught:
        publish_checkpoint(archive, base, limits=PublishLimits(max_total_bytes=1000))
    message = str(caught.value)
    assert "member 'adapter_model.safetensors' (100000 bytes) brings the extracted size past" in message
    assert "max_total_bytes=1000" in message and "PublishLimits(max_total_bytes=...)" in message
    assert os.listdir(base) == []


def test_publish_not_a_tar_archive(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A file that is not a tar archive gives a PublishError saying what to pass instead."""
    bogus = tmp_path / "step.tar.gz"
    bogus.write_bytes(b"definitely not a tar archive" * 100)
    with pytest.raises(PublishError, match=r"cannot read .*step\.tar\.gz: .*not a tar archive"):
        publish_checkpoint(bogus, base)
    assert os.listdir(base) == []


def test_publish_truncated_archive(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A truncated .tar.gz gives a PublishError and leaves no temporary folder."""
    archive = write_archive(tmp_path / "step.tar.gz", adapter_members(weights=os.urandom(200_000)))
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(PublishError, match="cannot read"):
        publish_checkpoint(archive, base)
    assert os.listdir(base) == []


@pytest.mark.parametrize("layout", ["archive", "folder"])
def test_publish_interrupted_mid_read_closes_its_file_and_leaves_no_temporary_folder(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Ctrl-C while a checkpoint's file is being written (its chunks' generator suspended mid-file): the
    KeyboardInterrupt propagates as itself, the file being read is closed (its generator finished), the hashing thread
    ends and no temporary folder is left; the next publish publishes it whole."""
    weights = os.urandom(3 * _archive.CHUNK_SIZE)
    if layout == "archive":
        checkpoint = write_archive(tmp_path / "step.tar", adapter_members(weights=weights), mode="w")
    else:
        checkpoint = write_adapter_dir(tmp_path / "step", weights=weights)
    opened: List[Generator[bytes, None, None]] = []

    def recorded(path: str) -> Generator[bytes, None, None]:
        opened.append(_archive.file_chunks(path))
        return opened[-1]

    written: List[int] = []
    write_all = extract._write_all

    def interrupt(fd: int, data: bytes) -> None:
        if sum(written) > _archive.CHUNK_SIZE:  # mid-way through the weights
            raise KeyboardInterrupt
        written.append(len(data))
        write_all(fd, data)

    monkeypatch.setattr(publish, "file_chunks", recorded)
    monkeypatch.setattr(extract, "_write_all", interrupt)
    with pytest.raises(KeyboardInterrupt):
        publish_checkpoint(checkpoint, base)
    assert opened and all(inspect.getgeneratorstate(chunks) == inspect.GEN_CLOSED for chunks in opened)
    assert os.listdir(base) == []
    assert not [thread for thread in threading.enumerate() if thread.name == "lora_sampler-sha256"]
    monkeypatch.undo()
    adapter = publish_checkpoint(checkpoint, base)
    assert os.listdir(base) == [adapter.name]


# -- layouts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "mode", "prefix"),
    [
        ("step-400.tar.gz", "w:gz", ""),
        ("step-400.tgz", "w:gz", "step-400/"),
        ("step-400.tar", "w", ""),
        ("step-400.tar", "w", "step-400/"),
        ("step-400.tar.gz", "w:gz", "./"),
    ],
)
def test_publish_archive_layouts(
    tmp_path: pathlib.Path, base: pathlib.Path, filename: str, mode: str, prefix: str
) -> None:
    """Files at the root or in one top-level folder, .tar or gzip: adapter_config.json lands at the folder's root."""
    members = adapter_members(prefix)
    if prefix.strip("./"):
        members.insert(0, special_member(prefix.rstrip("/"), tarfile.DIRTYPE))
    archive = write_archive(tmp_path / filename, members, mode)
    adapter = publish_checkpoint(archive, base)
    assert adapter.name.startswith("step-400-")
    assert adapter.path == str(base / adapter.name)
    assert adapter.source == str(archive)
    assert_published(adapter.path)
    assert os.listdir(base) == [adapter.name]


def test_publish_nested_folders_are_kept(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """Sub-folders of the adapter (e.g. a tokenizer) are extracted under the adapter folder."""
    members = [*adapter_members("step/"), file_member("step/tokenizer/vocab.json", b"{}")]
    adapter = publish_checkpoint(write_archive(tmp_path / "step.tgz", members), base)
    assert (pathlib.Path(str(adapter.path)) / "tokenizer" / "vocab.json").read_bytes() == b"{}"


def test_publish_directory_checkpoint(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """An adapter folder is copied (as plain files, symlinks resolved) and published under a content name."""
    source = write_adapter_dir(tmp_path / "ckpt" / "step-7", weights=b"real weights")
    os.remove(source / "adapter_model.safetensors")
    (tmp_path / "blob").write_bytes(b"real weights")
    os.symlink(tmp_path / "blob", source / "adapter_model.safetensors")  # a Hugging Face cache snapshot
    adapter = publish_checkpoint(source, base)
    assert adapter.name.startswith("step-7-")
    assert_published(adapter.path, weights=b"real weights")
    assert not os.path.islink(os.path.join(str(adapter.path), "adapter_model.safetensors"))
    assert publish_checkpoint(str(source) + os.sep, base) == adapter


def test_publish_directory_copies_only_the_adapter_files(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A training run's checkpoint folder holds more than the adapter (optimizer state, logs, private notes): only
    its config and weights are copied into the shared resolver folder, and only they make its content name."""
    source = write_adapter_dir(tmp_path / "step-8")
    plain = publish_checkpoint(source, base)
    (source / "secret.txt").write_text("not for the shared folder")
    (source / "optimizer").mkdir()
    (source / "optimizer" / "state.pt").write_bytes(b"x" * 1000)
    again = publish_checkpoint(source, base)
    assert again == plain
    published = sorted(name for name in os.listdir(str(again.path)) if not name.startswith("."))  # and our marker
    assert published == ["adapter_config.json", "adapter_model.safetensors"]


def test_publish_directory_with_fifo_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A FIFO as an adapter file is refused (reading it would hang); one beside the adapter is never read."""
    source = write_adapter_dir(tmp_path / "step")
    os.mkfifo(source / "pipe")
    publish_checkpoint(source, base)
    for name in os.listdir(base):
        shutil.rmtree(base / name)
    os.mkfifo(source / "adapter_model.bin")
    with pytest.raises(PublishError, match="not a regular file"):
        publish_checkpoint(source, base)
    assert os.listdir(base) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_publish_a_named_pipe_as_the_archive_is_refused_unread(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A checkpoint path that is a FIFO named like an archive is refused from ``stat`` (was: opened, waiting for a
    writer for ever). Run in a thread, so a regression fails after 10 s instead of holding the suite."""
    pipe = tmp_path / "step-1.tar.gz"
    os.mkfifo(pipe)
    raised: List[BaseException] = []

    def publish() -> None:
        try:
            publish_checkpoint(pipe, base)
        except BaseException as error:  # handed to the test's thread
            raised.append(error)

    worker = threading.Thread(target=publish, daemon=True)
    worker.start()
    worker.join(10)
    assert raised and isinstance(raised[0], PublishError) and "not a regular file" in str(raised[0])
    assert os.listdir(base) == []


def test_publish_folder_mode_follows_umask(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """The published folder is readable by others as the umask allows (an engine may run as another user)."""
    umask = os.umask(0o022)
    try:
        adapter = publish_checkpoint(write_archive(tmp_path / "a.tgz", adapter_members()), base)
    finally:
        os.umask(umask)
    assert os.stat(str(adapter.path)).st_mode & 0o777 == 0o755


@pytest.mark.parametrize(
    "members",
    [
        [file_member("weights.bin", b"w")],
        adapter_members("a/") + adapter_members("b/"),
    ],
    ids=["no config", "two top-level folders"],
)
def test_publish_without_config_at_root(tmp_path: pathlib.Path, base: pathlib.Path, members: List[Member]) -> None:
    """An archive without adapter_config.json at its root or in one top folder is an AdapterConfigError."""
    with pytest.raises(AdapterConfigError, match=r"has no adapter_config\.json"):
        publish_checkpoint(write_archive(tmp_path / "x.tgz", members), base)
    assert os.listdir(base) == []


def test_publish_non_lora_config_is_refused(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A checkpoint whose config is not a LoRA is refused before it is published."""
    members = adapter_members(config={"peft_type": "IA3", "base_model_name_or_path": ENGINE_MODEL})
    with pytest.raises(AdapterConfigError, match="peft_type='IA3'"):
        publish_checkpoint(write_archive(tmp_path / "x.tgz", members), base)
    assert os.listdir(base) == []


def test_publish_missing_inputs(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A missing checkpoint or lora_base_dir is a PublishError naming the path."""
    archive = write_archive(tmp_path / "a.tgz", adapter_members())
    with pytest.raises(PublishError, match=r"lora_base_dir .*nowhere"):
        publish_checkpoint(archive, tmp_path / "nowhere")
    with pytest.raises(PublishError, match=r"missing\.tgz does not exist"):
        publish_checkpoint(tmp_path / "missing.tgz", base)


# -- names and digests ---------------------------------------------------------------------------------------------


def test_publish_same_content_same_name_changed_content_new_name(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """The default name follows the content: same bytes give the same name, changed weights a new one."""
    first = publish_checkpoint(write_archive(tmp_path / "step.tgz", adapter_members(weights=b"v1")), base)
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "step.tgz"
    copy.write_bytes((tmp_path / "step.tgz").read_bytes())
    assert publish_checkpoint(copy, base).name == first.name
    changed = publish_checkpoint(write_archive(tmp_path / "step.tgz", adapter_members(weights=b"v2")), base)
    assert changed.name != first.name
    assert changed.digest != first.digest
    assert sorted(os.listdir(base)) == sorted([first.name, changed.name])
    assert_published(changed.path, weights=b"v2")


@pytest.mark.parametrize(
    ("filename", "stem"),
    [
        ("my model (v2).tar.gz", "my-model-v2-"),
        (".hidden.tgz", "hidden-"),
        ("a..b.tar", "a.b-"),
        ("step-400.TAR.GZ", "step-400-"),
        ("ünïcode.tgz", "n-code-"),
        ("---.tgz", "adapter-"),
        ("x" * 200 + ".tgz", "x" * publish.DEFAULT_STEM_LENGTH + "-"),
    ],
)
def test_default_adapter_name_is_a_safe_component(tmp_path: pathlib.Path, filename: str, stem: str) -> None:
    """Default names are a sanitised stem plus 12 hex digits of the sha256, and pass validate_adapter_name."""
    archive = write_archive(tmp_path / filename, adapter_members())
    name = default_adapter_name(archive)
    digest = publish.checkpoint_digest(archive)
    assert name == stem + digest[:12]
    assert validate_adapter_name(name) == name


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "is empty"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("../x", "path separator"),
        (".", "starts with a dot"),
        ("..", "starts with a dot"),
        (".hidden", "starts with a dot"),
        ("x" * 201, "longer than 200"),
        ("tab\there", "U+0009"),
        ("bell\x07", "U+0007"),
        ("evil\u202egpj.exe", "U+202E"),
        ("lone\udcff", "U+DCFF"),
        ("caf\u00e9", "U+00E9"),
        ("sp ace", "U+0020"),
        ("step.tar.gz", "ends like an archive"),
    ],
)
def test_validate_adapter_name_refuses_unsafe_names(name: str, problem: str) -> None:
    """Unsafe adapter names raise ValueError naming the argument and the problem."""
    with pytest.raises(ValueError, match="name=") as caught:
        validate_adapter_name(name)
    assert problem in str(caught.value)
    assert NAME_RULE in str(caught.value)
    str(caught.value).encode("ascii")  # the message itself never carries the hostile characters
    with pytest.raises(TypeError, match="name must be a str"):
        validate_adapter_name(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a..b", "step-400", "A_b.c-9", "x" * 200])
def test_validate_adapter_name_accepts_exactly_the_stated_rule(name: str) -> None:
    """Every name the rule allows passes (``a..b`` is one path component, not a parent reference)."""
    assert validate_adapter_name(name) == name


def test_publish_explicit_bad_name_raises_before_io(tmp_path: pathlib.Path) -> None:
    """An invalid explicit name is a ValueError before the checkpoint or base folder is looked at."""
    with pytest.raises(ValueError, match=re.escape("name='../evil'")):
        publish_checkpoint(tmp_path / "missing.tgz", tmp_path / "missing", name="../evil")


def test_publish_republish_reads_nothing(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archive is hashed once, while it is extracted; a republish reads nothing (the published folder records the
    file's signature); a touched file is read once more, into the same folder, and then not again."""
    calls: List[str] = []
    extracted: List[str] = []
    real_hash, real_extract = _archive._sha256_file, publish.extract_archive

    def counting_hash(path: str) -> str:
        calls.append(path)
        return real_hash(path)

    def counting_extract(archive: str, *args: object, **kwargs: object) -> str:
        extracted.append(archive)
        return real_extract(archive, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_archive, "_sha256_file", counting_hash)
    monkeypatch.setattr(publish, "extract_archive", counting_extract)
    archive = write_archive(tmp_path / "step.tgz", adapter_members())
    first = publish_checkpoint(archive, base)
    assert publish_checkpoint(archive, base) == first
    assert (len(extracted), calls) == (1, [])  # the cold publish hashed the bytes it extracted
    other_base = tmp_path / "other"
    other_base.mkdir()
    assert publish_checkpoint(archive, other_base).name == first.name
    assert first.digest == real_hash(str(archive))
    stat = os.stat(archive)
    os.utime(archive, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert publish_checkpoint(archive, base) == first  # touched: read once more, same content, same folder
    assert publish_checkpoint(archive, base) == first  # and its record now has the new signature
    assert (len(extracted), calls) == (3, [])
    assert default_adapter_name(archive) == first.name and calls == [str(archive)]  # the name alone reads it


def test_publish_updates_a_record_without_the_signature_after_one_read(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder whose record lacks the checkpoint's signature (published by an older lora_sampler) is found by its
    content after one read into a temporary folder; its record then holds the signature and the next publish reads
    nothing. A record is replaced whole, never left half-written."""
    archive = write_archive(tmp_path / "step.tgz", adapter_members())
    first = publish_checkpoint(archive, base)
    marker = pathlib.Path(str(first.path), MARKER_FILE)
    record = json.loads(marker.read_text())
    signature = record.pop("stored")
    marker.write_text(json.dumps(record))
    extracted: List[str] = []
    real_extract = publish.extract_archive

    def counting_extract(archive: str, *args: object, **kwargs: object) -> str:
        extracted.append(archive)
        return real_extract(archive, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(publish, "extract_archive", counting_extract)
    assert publish_checkpoint(archive, base) == first
    assert publish_checkpoint(archive, base) == first
    assert len(extracted) == 1 and sorted(os.listdir(base)) == [first.name]
    assert json.loads(marker.read_text()) == {**record, "stored": signature}
    assert sorted(os.listdir(str(first.path))) == [MARKER_FILE, "adapter_config.json", "adapter_model.safetensors"]


def test_publish_fast_path_does_not_extract(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder already holding the same digest is returned at once, without extracting."""
    archive = write_archive(tmp_path / "step.tgz", adapter_members())
    first = publish_checkpoint(archive, base)

    def no_extract(*args: object, **kwargs: object) -> None:
        raise AssertionError("extracted again")

    monkeypatch.setattr(publish, "extract_archive", no_extract)
    assert publish_checkpoint(archive, base) == first
    assert publish_checkpoint(archive, base, name=first.name) == first


def test_publish_explicit_name_with_other_content_names_both_digests(
    tmp_path: pathlib.Path, base: pathlib.Path
) -> None:
    """An explicit name that already holds different content is an error naming both digests."""
    old = publish_checkpoint(write_archive(tmp_path / "old.tgz", adapter_members(weights=b"old")), base, name="mine")
    new_archive = write_archive(tmp_path / "new.tgz", adapter_members(weights=b"new"))
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(new_archive, base, name="mine")
    message = str(caught.value)
    assert str(old.digest) in message
    assert publish.checkpoint_digest(new_archive) in message
    assert "another name" in message
    assert_published(old.path, weights=b"old")
    assert os.listdir(base) == ["mine"]


def test_publish_explicit_name_over_foreign_folder(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A folder not published by lora_sampler is never reused under an explicit name."""
    write_adapter_dir(base / "handmade")
    with pytest.raises(PublishError, match="unknown"):
        publish_checkpoint(write_archive(tmp_path / "a.tgz", adapter_members()), base, name="handmade")


def test_publish_folder_already_in_place(base: pathlib.Path) -> None:
    """Publishing a folder under its own name inside lora_base_dir returns it as is."""
    source = write_adapter_dir(base / "in-place")
    adapter = publish_checkpoint(source, base, name="in-place")
    assert adapter.path == str(source)
    assert os.listdir(base) == ["in-place"]
    assert adapter.digest == publish.checkpoint_digest(source)


def test_publish_marker_records_digest_and_source(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """The published folder records the checkpoint's digest and source."""
    archive = write_archive(tmp_path / "a.tgz", adapter_members())
    adapter = publish_checkpoint(archive, base)
    record = json.loads(pathlib.Path(str(adapter.path), MARKER_FILE).read_text())
    assert record["digest"] == adapter.digest == publish.checkpoint_digest(archive)
    assert record["source"] == str(archive)
    assert publish.read_published_digest(str(adapter.path)) == adapter.digest


def losing_rename(monkeypatch: pytest.MonkeyPatch, rival: Callable[[], object]) -> None:
    """Make another publisher win: run ``rival`` just before our rename (the lock is re-entrant per thread)."""
    real_write_marker = publish._write_marker
    fired: List[bool] = []

    def write_marker_then_lose(root: str, digest: str, source: str, stored: object = None) -> None:
        real_write_marker(root, digest, source, stored)
        if not fired:
            fired.append(True)
            rival()

    monkeypatch.setattr(publish, "_write_marker", write_marker_then_lose)


def test_publish_losing_the_rename_returns_the_winner(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When another publisher renames first (ENOTEMPTY), we clean up and return its identical folder."""
    archive = write_archive(tmp_path / "a.tgz", adapter_members())
    winners: List[object] = []
    losing_rename(monkeypatch, lambda: winners.append(publish_checkpoint(archive, base)))
    adapter = publish_checkpoint(archive, base)
    assert winners == [adapter]
    assert os.listdir(base) == [adapter.name]
    assert_published(adapter.path)


def test_publish_losing_the_rename_to_other_content_is_an_error(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the winner of the rename holds different content, the loser raises naming both digests."""
    ours = write_archive(tmp_path / "ours.tgz", adapter_members(weights=b"ours"))
    theirs = write_archive(tmp_path / "theirs.tgz", adapter_members(weights=b"theirs"))
    losing_rename(monkeypatch, lambda: publish_checkpoint(theirs, base, name="shared"))
    with pytest.raises(PublishError, match="already holds different content"):
        publish_checkpoint(ours, base, name="shared")
    assert os.listdir(base) == ["shared"]
    assert_published(str(base / "shared"), weights=b"theirs")


# -- stale temporaries and removal ---------------------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_clean_stale_temporaries(base: pathlib.Path) -> None:
    """Temporaries of dead local processes, and old ones from anywhere, are removed; live ones are kept."""
    tag = _archive._HOST_TAG
    other_tag = "0" * 8 if tag != "0" * 8 else "1" * 8
    names = {
        "dead": f".tmp-a-{tag}-{dead_pid()}-0123abcd",
        "live": f".tmp-a-{tag}-{os.getpid()}-0123abcd",
        "remote fresh": f".tmp-a-{other_tag}-1-0123abcd",
        "remote old": f".tmp-a-{other_tag}-2-0123abcd",
        "old removal": f".del-a-{other_tag}-3-0123abcd",
        "not ours": ".cache",
    }
    for name in names.values():
        (base / name).mkdir()
        (base / name / "adapter_config.json").write_text("{")
    two_hours_ago = time.time() - 7200
    for key in ("remote old", "old removal"):
        os.utime(base / names[key], (two_hours_ago, two_hours_ago))
    removed = clean_stale_temporaries(base)
    assert sorted(removed) == sorted(str(base / names[k]) for k in ("dead", "remote old", "old removal"))
    assert sorted(os.listdir(base)) == sorted(names[k] for k in ("live", "remote fresh", "not ours"))


def test_publish_cleans_stale_temporaries(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A cold publish removes a crashed publisher's leftover and never uses it."""
    leftover = base / f".tmp-step-{_archive._HOST_TAG}-{dead_pid()}-0123abcd"
    leftover.mkdir()
    (leftover / "adapter_config.json").write_text("{")
    adapter = publish_checkpoint(write_archive(tmp_path / "step.tgz", adapter_members()), base)
    assert os.listdir(base) == [adapter.name]
    assert_published(adapter.path)


def test_remove_adapter_dir(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """remove_adapter_dir deletes a published folder, leaves no temporary, and reports whether it did."""
    adapter = publish_checkpoint(write_archive(tmp_path / "a.tgz", adapter_members()), base)
    assert remove_adapter_dir(base, adapter.name) is True
    assert os.listdir(base) == []
    assert remove_adapter_dir(base, adapter.name) is False


@pytest.mark.parametrize("name", ["../outside", "..", "/etc", "a/../../outside", ".hidden", ""])
def test_remove_adapter_dir_refuses_escaping_names(tmp_path: pathlib.Path, base: pathlib.Path, name: str) -> None:
    """Names that could escape lora_base_dir are refused and nothing is deleted."""
    (tmp_path / "outside").mkdir()
    with pytest.raises(ValueError, match="not a valid adapter name"):
        remove_adapter_dir(base, name)
    assert (tmp_path / "outside").is_dir()


def test_remove_adapter_dir_unlinks_symlinks_only(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    """A symlink in lora_base_dir is unlinked; the folder it points to is left alone."""
    target = write_adapter_dir(tmp_path / "elsewhere")
    os.symlink(target, base / "linked")
    assert remove_adapter_dir(base, "linked") is True
    assert os.listdir(base) == []
    assert_published_dir = sorted(os.listdir(target))
    assert assert_published_dir == ["adapter_config.json", "adapter_model.safetensors"]


# -- preflight -----------------------------------------------------------------------------------------------------


def test_check_adapter_config_accepts_matching_config(tmp_path: pathlib.Path) -> None:
    """A LoRA config for the engine's exact model passes and is returned."""
    folder = write_adapter_dir(tmp_path / "a")
    assert check_adapter_config(folder, ENGINE_MODEL) == CONFIG
    assert check_adapter_config(folder, None) == CONFIG


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, ["adapter_config.json is missing", "save_pretrained"]),
        ('{"peft_type": "LORA", ', ["not readable JSON", "Expecting", "re-save"]),
        ("[1, 2]", ["holds a list", "re-save"]),
        (json.dumps({**CONFIG, "peft_type": "PREFIX_TUNING"}), ["peft_type='PREFIX_TUNING'", "'LORA'", "LoraConfig"]),
        (
            json.dumps({**CONFIG, "base_model_name_or_path": "tiny-model"}),
            [
                "base_model_name_or_path='tiny-model'",
                f"engine serves {ENGINE_MODEL!r}",
                f"re-save the adapter with base_model_name_or_path={ENGINE_MODEL!r}",
            ],
        ),
        (
            json.dumps({k: v for k, v in CONFIG.items() if k != "base_model_name_or_path"}),
            ["base_model_name_or_path=None", f"base_model_name_or_path={ENGINE_MODEL!r}"],
        ),
    ],
    ids=["missing", "bad json", "not an object", "wrong peft_type", "wrong base model", "no base model"],
)
def test_check_adapter_config_diagnoses(tmp_path: pathlib.Path, content: Optional[str], expected: List[str]) -> None:
    """Each preflight failure names the file, the values found and expected, and the fix."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    if content is not None:
        (folder / "adapter_config.json").write_text(content)
    with pytest.raises(AdapterConfigError) as caught:
        check_adapter_config(folder, ENGINE_MODEL)
    message = str(caught.value)
    assert str(folder / "adapter_config.json") in message
    for part in expected:
        assert part in message


@pytest.mark.parametrize("kind", ["archive", "folder"])
def test_publish_local_checkpoint_changed_while_it_is_read_is_refused(
    tmp_path: pathlib.Path, base: pathlib.Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A trainer still writing the checkpoint while it is extracted or copied: the publish is refused, naming it,
    and nothing is left in the adapter folder; once the writer is done the same path publishes its new content."""
    if kind == "archive":
        source = write_archive(tmp_path / "step-3.tar.gz", adapter_members())
        grown = source
        fill_name = "extract_archive"
    else:
        source = write_adapter_dir(tmp_path / "step-3")
        grown = source / "adapter_model.safetensors"
        fill_name = "copy_files"
    real_fill = getattr(publish, fill_name)

    def fill_then_grow(*args: object, **kwargs: object) -> object:
        digest = real_fill(*args, **kwargs)
        with open(grown, "ab") as file:  # the writer appends after the reader has read it all
            file.write(b"more")
        return digest

    monkeypatch.setattr(publish, fill_name, fill_then_grow)
    with pytest.raises(PublishError, match="changed while it was being published; publish it again") as info:
        publish_checkpoint(source, base)
    assert str(source) in str(info.value)
    assert snapshot(base) == []
    monkeypatch.setattr(publish, fill_name, real_fill)
    if kind == "folder":
        assert_published(publish_checkpoint(source, base).path, weights=b"weights-1more")
    else:
        with pytest.raises(PublishError):  # an archive with bytes after its end is refused as such
            publish_checkpoint(source, base)
