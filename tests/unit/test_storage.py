"""Storage URLs without a server: detection, the missing extra, the stream seam of the extraction, redaction."""

from __future__ import annotations

import pathlib
import sys
import tarfile
import threading
from typing import Any, Dict, List, Optional

import pytest

from lora_sampler._adapters import storage
from lora_sampler._adapters.extract import PublishLimits, copy_files, extract_archive
from lora_sampler._defaults import DEFAULT_STORAGE_MIN_RATE, DEFAULT_TIMEOUT
from lora_sampler.errors import PublishError, UnsafeArchiveError
from lora_sampler.publish import checkpoint_digest, publish_checkpoint
from lora_sampler.testing import write_adapter
from lora_sampler.types import is_checkpoint_path, is_storage_url


def make_archive(tmp_path: pathlib.Path) -> pathlib.Path:
    write_adapter(tmp_path / "src" / "step-9", "tiny-base")
    archive = tmp_path / "step-9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "step-9", arcname="step-9")
    return archive


def chunks_of(data: bytes, size: int) -> storage.Chunks:
    yield from (data[i : i + size] for i in range(0, len(data), size))


def download(chunks: storage.Chunks, size: int, options: Optional[Dict[str, Any]] = None) -> storage.Chunks:
    """What ``open_object`` hands out, over ``chunks`` instead of a store's."""
    return storage._download(chunks, storage.StoredObject("s3://b/k", size, None, None, False), options)


@pytest.mark.parametrize("url", ["s3://ckpts/run/step-1.tar.gz", "gs://ckpts/run/step-1/", "GCS://b/k", "S3://b/k"])
def test_types_storage_urls_are_checkpoint_paths(url: str) -> None:
    """s3://, gs:// (and gcsfs's gcs://) URLs are checkpoint paths, whatever the scheme's case."""
    assert is_storage_url(url) and is_checkpoint_path(url)


@pytest.mark.parametrize("value", ["s3://", "http://host/x.tar.gz", "step-1", "s3:/b/k", 7])
def test_types_other_values_are_not_storage_urls(value: object) -> None:
    """An empty URL, other schemes, names and non-strings are not storage URLs."""
    assert not is_storage_url(value)


@pytest.mark.parametrize(
    ("url", "extra", "module"), [("s3://b/k.tar.gz", "s3", "s3fs"), ("gs://b/k.tar.gz", "gcs", "gcsfs")]
)
def test_storage_url_without_the_extra_names_it(
    url: str, extra: str, module: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the storage library a URL is a PublishError naming the extra to install; nothing is written."""
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError, as if not installed
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(url, tmp_path)
    assert f"pip install 'lora_sampler[{extra}]'" in str(caught.value) and url in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_storage_without_fsspec_names_the_extra(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec itself missing names the same extra."""
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)  # an earlier test may have imported it
    with pytest.raises(PublishError, match=r"lora_sampler\[s3\]"):
        publish_checkpoint("s3://b/k.tar.gz", tmp_path)


def test_extract_archive_reads_a_stream_like_the_file(tmp_path: pathlib.Path) -> None:
    """An archive streamed in odd-sized chunks extracts the same files and gives the file's digest."""
    archive = make_archive(tmp_path)
    data = archive.read_bytes()
    dest = tmp_path / "dest"
    dest.mkdir()
    digest = extract_archive("s3://b/step-9.tar.gz", str(dest), chunks=download(chunks_of(data, 777), len(data)))
    assert digest == checkpoint_digest(archive)
    assert (dest / "step-9" / "adapter_config.json").is_file()


def test_storage_short_object_is_a_publish_error(tmp_path: pathlib.Path) -> None:
    """A stream that ends before the object's size is a PublishError naming the URL and both sizes."""
    chunks = download(chunks_of(b"abc", 100), 10)
    assert next(chunks) == b"abc"
    with pytest.raises(PublishError, match=r"s3://b/k: the object ended after 3 of its 10 bytes"):
        next(chunks)


def test_storage_download_error_blanks_the_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A download error naming a secret of the options or the environment is raised with the secret blanked."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-from-env-123")

    def failing() -> storage.Chunks:
        yield b"ab"
        raise ConnectionError("reset by peer; key=hunter2secret token-from-env-123")

    options = {"key": "AKIDEXAMPLE", "secret": "hunter2secret", "client_kwargs": {"region_name": "us-east-1"}}
    with pytest.raises(PublishError) as caught:
        list(download(failing(), 10, options))
    message = str(caught.value)
    assert "s3://b/k" in message and "ConnectionError" in message
    assert "hunter2secret" not in message and "token-from-env-123" not in message


def test_storage_reader_reads_only_what_is_asked_and_closing_ends_the_download(tmp_path: pathlib.Path) -> None:
    """The extraction fetches a chunk only when it needs one (bounded memory, no thread reading ahead), and closing
    the download before its end closes the store's (an endless source is not drained)."""
    fetched: List[int] = []
    closed = threading.Event()

    def forever() -> storage.Chunks:
        try:
            while True:
                fetched.append(1)
                yield b"x" * 1024
        finally:
            closed.set()

    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(PublishError, match="not a tar archive"):  # the first block is no tar header
        extract_archive("s3://b/k", str(dest), chunks=download(forever(), 1 << 40))
    assert closed.is_set() and len(fetched) == 1


def test_storage_deadlines_come_from_the_options_else_the_timeout() -> None:
    """The storage options' botocore timeouts win over the client's; a transfer adds its size at the minimum rate."""
    assert storage.deadlines(storage.StorageOptions(timeout=(3.0, 7.0))).request == 10.0
    assert storage.deadlines(storage.StorageOptions(timeout=5.0)).request == 10.0
    options = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 2}}
    limits = storage.deadlines(storage.StorageOptions(options, timeout=(3.0, 7.0)))
    assert limits.request == 3.0
    assert limits.transfer(int(DEFAULT_STORAGE_MIN_RATE) * 4) == pytest.approx(7.0)
    assert storage.deadlines().request == sum(DEFAULT_TIMEOUT)


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("run/step-*", "run/step-1.tar.gz", True),
        ("run/step-*", "run/step-1/adapter_config.json", False),
        ("run/**/step-*.tar.gz", "run/a/b/step-2.tar.gz", True),
        ("run/step-?.tgz", "run/step-10.tgz", False),
        ("run/step-[0-9].tgz", "run/step-7.tgz", True),
        ("run/step-[!0-9].tgz", "run/step-7.tgz", False),
        ("run//step-*", "run//step-1.tar.gz", True),
        ("run/step-(1)+*", "run/step-(1)+x.tar", True),
        ("run/step-(1)+*", "run/step-11x.tar", False),
    ],
)
def test_storage_glob_translation(pattern: str, name: str, matches: bool) -> None:
    """``*``/``?`` stay in a segment, ``**`` crosses them, sets work, and regex characters in keys are literal."""
    assert bool(storage._glob_regex(pattern).fullmatch(name)) is matches


@pytest.mark.parametrize(
    ("keys", "limits", "refusal"),
    [
        (["adapter_config.json", "sub/../../escape.bin"], PublishLimits(), r"'\.\.' segment"),
        (["adapter_config.json", "b", "c"], PublishLimits(max_members=2), r"max_members=2 members \(member 'c'\)"),
        (["a/b", "a//b"], PublishLimits(), "appears twice"),
    ],
)
def test_storage_folder_keys_are_checked_before_any_download(
    tmp_path: pathlib.Path, keys: List[str], limits: PublishLimits, refusal: str
) -> None:
    """A stored folder's keys go through the archive members' checks, every one before the first object is read."""
    opened: List[str] = []

    def opener(key: str) -> storage.Chunks:
        opened.append(key)
        yield b"{}"

    files = [(key, 2, opener(key)) for key in keys]
    with pytest.raises(UnsafeArchiveError, match=refusal):
        copy_files("s3://b/step-7", files, str(tmp_path), limits=limits)
    assert opened == [] and list(tmp_path.iterdir()) == []


def test_storage_folder_key_is_taken_like_the_tar_member_of_that_name(tmp_path: pathlib.Path) -> None:
    """``sub//x`` and ``./y`` are the files ``sub/x`` and ``y``, as the tar members of those names would be."""
    files = [(key, 1, chunks_of(b"z", 1)) for key in ("sub//x", "./y")]
    copy_files("s3://b/step-7", files, str(tmp_path))
    assert (tmp_path / "sub" / "x").read_bytes() == b"z" and (tmp_path / "y").read_bytes() == b"z"
