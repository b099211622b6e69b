"""Publishing checkpoints from a real S3 API server on loopback (moto): archives, folders, failures, republish."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, List

import pytest
from _s3server import BUCKET, S3Server, build_archive, make_user, temporaries

from lora_sampler._adapters import extract, storage
from lora_sampler.errors import PublishError, UnsafeArchiveError
from lora_sampler.publish import publish_checkpoint

URL = f"s3://{BUCKET}/run1/step-400.tar.gz"


def upload(s3: Any, path: Path, key: str = "run1/step-400.tar.gz") -> str:
    s3.upload_file(str(path), BUCKET, key)
    return f"s3://{BUCKET}/{key}"


def test_storage_publish_url_is_read_from_the_store(s3: Any, tmp_path: Path, lora_dir: Path) -> None:
    """publish_checkpoint("s3://...") extracts the object (the issue's reproduction: it was a relative path)."""
    upload(s3, build_archive(tmp_path, "step-400"))
    adapter = publish_checkpoint(URL, lora_dir)
    assert adapter.name.startswith("step-400-") and adapter.source == URL
    assert (lora_dir / adapter.name / "adapter_config.json").is_file()
    assert os.listdir(lora_dir) == [adapter.name]


def test_storage_publish_gives_the_local_file_its_name(s3: Any, tmp_path: Path, lora_dir: Path) -> None:
    """The same bytes give the same adapter name and digest from storage as from the local file."""
    archive = build_archive(tmp_path, "step-400")
    upload(s3, archive)
    local_dir = tmp_path / "local-loras"
    local_dir.mkdir()
    local = publish_checkpoint(archive, local_dir)
    stored = publish_checkpoint(URL, lora_dir)
    assert (stored.name, stored.digest) == (local.name, local.digest)


def test_storage_republish_is_one_metadata_request(
    s3: Any, s3_server: S3Server, tmp_path: Path, lora_dir: Path
) -> None:
    """Publishing the same object again is one HEAD, in this process and in a fresh one (the marker records it)."""
    upload(s3, build_archive(tmp_path, "step-400"))
    first = publish_checkpoint(URL, lora_dir)
    before = s3_server.counts()
    assert publish_checkpoint(URL, lora_dir) == first
    after_cached = s3_server.counts()
    assert publish_checkpoint(URL, lora_dir) == first
    after_marker = s3_server.counts()
    assert delta(before, after_cached) == {"HEAD": 1}
    assert delta(after_cached, after_marker) == {"HEAD": 1}


def test_storage_rewritten_object_is_published_anew(s3: Any, tmp_path: Path, lora_dir: Path) -> None:
    """New bytes under the same key (a new ETag) are downloaded again and get a new content-derived name."""
    upload(s3, build_archive(tmp_path / "a", "step-400"))
    first = publish_checkpoint(URL, lora_dir)
    upload(s3, build_archive(tmp_path / "b", "step-400", padding=100))
    second = publish_checkpoint(URL, lora_dir)
    assert second.name != first.name and second.digest != first.digest
    assert sorted(os.listdir(lora_dir)) == sorted([first.name, second.name])


def test_storage_folder_checkpoint_is_copied(s3: Any, s3_server: S3Server, tmp_path: Path, lora_dir: Path) -> None:
    """A prefix holding adapter_config.json and weights publishes like the local folder (same name and digest)."""
    archive = build_archive(tmp_path, "step-7")
    folder = tmp_path / "src" / "step-7"
    for file in sorted(folder.iterdir()):
        s3.upload_file(str(file), BUCKET, f"run1/step-7/{file.name}")
    stored = publish_checkpoint(f"s3://{BUCKET}/run1/step-7", lora_dir)
    local_dir = tmp_path / "local-loras"
    local_dir.mkdir()
    local = publish_checkpoint(folder, local_dir)
    assert (stored.name, stored.digest) == (local.name, local.digest)
    assert sorted(os.listdir(lora_dir / stored.name)) == sorted([".lora_sampler.json", *os.listdir(folder)])
    before = s3_server.counts()
    assert publish_checkpoint(f"s3://{BUCKET}/run1/step-7/", lora_dir).name == stored.name
    middle = s3_server.counts()
    assert publish_checkpoint(f"s3://{BUCKET}/run1/step-7", lora_dir).name == stored.name
    assert delta(before, middle) == {"GET": 1}  # republishing a prefix/ is its listing
    assert delta(middle, s3_server.counts()) == {"GET": 1}  # without the slash too (a HEAD and two listings before)
    assert archive.exists()


def test_storage_folders_holding_their_adapter_in_a_subfolder_are_named_by_it(
    s3: Any, tmp_path: Path, lora_dir: Path
) -> None:
    """Two prefixes of one name, each holding a different adapter inside one top-level folder, get their own
    digests and names, each the digest of that adapter folder published locally (on 51a52b5 both got the digest
    of no files at all, one name, and the second publish returned the first one's weights)."""
    from lora_sampler.testing import write_adapter

    published = []
    for run, rank in (("runA", 4), ("runB", 8)):
        folder = write_adapter(tmp_path / run / "final", "tiny-base", rank=rank)
        for file in sorted(Path(folder).iterdir()):
            s3.upload_file(str(file), BUCKET, f"{run}/final/step/{file.name}")
        stored = publish_checkpoint(f"s3://{BUCKET}/{run}/final", lora_dir)
        local_dir = tmp_path / run / "local-loras"
        local_dir.mkdir()
        assert stored.digest == publish_checkpoint(folder, local_dir).digest
        published.append(stored)
    assert published[0].name != published[1].name and published[0].digest != published[1].digest


def test_storage_folder_with_a_hostile_key_is_refused(s3: Any, tmp_path: Path, lora_dir: Path) -> None:
    """An object key with a '..' segment below the prefix is refused like an archive member; nothing is left."""
    build_archive(tmp_path, "step-8")
    folder = tmp_path / "src" / "step-8"
    for file in folder.iterdir():
        s3.upload_file(str(file), BUCKET, f"run1/step-8/{file.name}")
    s3.put_object(Bucket=BUCKET, Key="run1/step-8/sub/../../escape.bin", Body=b"x")
    with pytest.raises(UnsafeArchiveError, match=r"\.\."):
        publish_checkpoint(f"s3://{BUCKET}/run1/step-8", lora_dir)
    assert os.listdir(lora_dir) == []


def test_storage_missing_key_names_the_url(s3: Any, lora_dir: Path) -> None:
    """A key that does not exist is a PublishError naming the URL; nothing is written."""
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(f"s3://{BUCKET}/run1/nope.tar.gz", lora_dir)
    assert f"s3://{BUCKET}/run1/nope.tar.gz" in str(caught.value) and "no such object" in str(caught.value)
    assert os.listdir(lora_dir) == []


def test_storage_missing_bucket_names_the_url(s3: Any, lora_dir: Path) -> None:
    """A bucket that does not exist is a PublishError naming the URL and the cause."""
    with pytest.raises(PublishError) as caught:
        publish_checkpoint("s3://no-such-bucket/step.tar.gz", lora_dir)
    assert "s3://no-such-bucket/step.tar.gz" in str(caught.value)
    assert "no such object, prefix or bucket" in str(caught.value)
    assert os.listdir(lora_dir) == []


def test_storage_wrong_credentials_are_denied_without_the_secret(
    s3: Any, s3_server: S3Server, tmp_path: Path, lora_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With auth enforced, a wrong secret is a PublishError saying access was denied, never showing the secret."""
    import s3fs

    upload(s3, build_archive(tmp_path, "step-400"))
    key, secret = make_user(s3_server.endpoint)
    s3_server.enforce_auth()
    wrong = "wrong-secret-" + secret[:8]
    with pytest.raises(PublishError) as caught:
        publish_checkpoint(URL, lora_dir, storage_options={"key": key, "secret": wrong})
    message = str(caught.value)
    assert URL in message and "access denied" in message and wrong not in message and secret not in message
    assert os.listdir(lora_dir) == []
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert publish_checkpoint(URL, lora_dir).name.startswith("step-400-")  # the right secret works


def test_storage_connection_cut_midway_publishes_nothing(
    s3: Any, s3_server: S3Server, tmp_path: Path, lora_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server killed during a 48 MiB download: a PublishError naming the URL, no adapter, no temporary folder."""
    upload(s3, build_archive(tmp_path, "step-400", padding=48 << 20))
    writing, server_gone = threading.Event(), threading.Event()
    real_write_all = extract._write_all

    def write_after_the_cut(fd: int, data: bytes) -> None:
        writing.set()
        server_gone.wait(30)  # the extraction holds still until the server is dead
        real_write_all(fd, data)

    monkeypatch.setattr(extract, "_write_all", write_after_the_cut)
    errors: List[BaseException] = []

    def run() -> None:
        try:
            publish_checkpoint(URL, lora_dir)
        except BaseException as error:
            errors.append(error)

    publisher = threading.Thread(target=run)
    publisher.start()
    assert writing.wait(30)
    s3_server.stop()
    server_gone.set()
    publisher.join(60)
    assert not publisher.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PublishError), errors
    assert URL in str(errors[0]) and "nothing was published" in str(errors[0])
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


def test_storage_concurrent_publishers_download_once(
    s3: Any, s3_server: S3Server, tmp_path: Path, lora_dir: Path
) -> None:
    """Eight threads publishing one URL leave one folder; the object is downloaded once (one GET)."""
    upload(s3, build_archive(tmp_path, "step-400"))
    before = s3_server.counts()
    results: List[Any] = []
    threads = [threading.Thread(target=lambda: results.append(publish_checkpoint(URL, lora_dir))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 8 and len({adapter.name for adapter in results}) == 1
    assert os.listdir(lora_dir) == [results[0].name]
    assert delta(before, s3_server.counts()).get("GET") == 1


def test_storage_marker_records_the_fingerprint(s3: Any, tmp_path: Path, lora_dir: Path) -> None:
    """The published folder's record names the URL and the object's ETag and size (what a republish compares)."""
    archive = build_archive(tmp_path, "step-400")
    upload(s3, archive)
    adapter = publish_checkpoint(URL, lora_dir)
    record = json.loads((lora_dir / adapter.name / ".lora_sampler.json").read_text())
    etag = s3.head_object(Bucket=BUCKET, Key="run1/step-400.tar.gz")["ETag"]
    assert record["source"] == URL and record["stored"] == [etag, None, archive.stat().st_size]


def delta(before: dict, after: dict) -> dict:
    """The requests answered between two ``counts()``, by method."""
    return {method: after[method] - before.get(method, 0) for method in after if after[method] != before.get(method, 0)}


def test_storage_expand_globs_archives_and_prefixes(s3: Any) -> None:
    """A glob over storage URLs matches archive objects and folder prefixes (not other objects), as s3:// URLs."""
    for key in ("run1/step-1.tar.gz", "run1/step-20.tgz", "run1/step-3/adapter_config.json", "run1/step-4.txt"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    found = storage.expand(f"s3://{BUCKET}/run1/step-*")
    assert sorted(found) == [f"s3://{BUCKET}/run1/{name}" for name in ("step-1.tar.gz", "step-20.tgz", "step-3")]
    assert storage.expand(f"s3://{BUCKET}/run1/step-1.tar.gz") == [f"s3://{BUCKET}/run1/step-1.tar.gz"]
    assert storage.expand(f"s3://{BUCKET}/run1/step-9.tar.gz") == []  # not there yet: a watch waits for it


def test_storage_settle_signature_follows_the_object(s3: Any) -> None:
    """An object's signature changes when it is rewritten; a missing one is FileNotFoundError (not there yet)."""
    url = f"s3://{BUCKET}/run1/step-1.tar.gz"
    with pytest.raises(FileNotFoundError):
        storage.settle_signature(url)
    s3.put_object(Bucket=BUCKET, Key="run1/step-1.tar.gz", Body=b"one")
    first = storage.settle_signature(url)
    s3.put_object(Bucket=BUCKET, Key="run1/step-1.tar.gz", Body=b"two!")
    second = storage.settle_signature(url)
    assert first[1] is None and second[1] is None and first[2] != second[2] and second[0] > 0


def test_storage_settle_signature_of_a_prefix_waits_for_the_config(s3: Any, s3_server: S3Server) -> None:
    """A prefix without adapter_config.json has a problem (incomplete); once it is uploaded it has none. Each look is
    one listing (a HEAD and two listings before); an archive's is one HEAD."""
    url = f"s3://{BUCKET}/run1/step-5"
    s3.put_object(Bucket=BUCKET, Key="run1/step-5/adapter_model.safetensors", Body=b"w")
    assert storage.settle_signature(url)[1] == "its adapter_config.json is not in the store yet"
    s3.put_object(Bucket=BUCKET, Key="run1/step-5/adapter_config.json", Body=b"{}")
    before = s3_server.counts()
    newest, problem, signature = storage.settle_signature(url)
    assert problem is None and len(signature[1]) == 2 and newest > 0
    assert delta(before, s3_server.counts()) == {"GET": 1}
    s3.put_object(Bucket=BUCKET, Key="run1/step-6.tar.gz", Body=b"archive")
    before = s3_server.counts()
    assert storage.settle_signature(f"s3://{BUCKET}/run1/step-6.tar.gz")[2][0] == "object"
    assert delta(before, s3_server.counts()) == {"HEAD": 1}
