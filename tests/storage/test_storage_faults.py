"""Object storage that misbehaves: silent, dripping, dropping, endless and changing stores (a loopback stand-in).

Each store call must end within its deadline, which the store cannot extend: a request within the connect plus read
timeout (the client's, or the storage options' own), an object within that plus its size at the minimum rate, a
listing page the same. Measured on a1a82fa: a store that never answered was still waited on at 300 s, a GET
dripping a byte per 0.5 s took 259.7 s for a 518-byte archive, a dripped listing 226 s. Each test runs the call in a
thread and gives it ``BOUND`` seconds, far more than its deadline and far less than those waits: a call still running
then has no bound (the test fails instead of hanging).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from _faultstore import BUCKET, FaultStore, count, outcome_within
from _s3server import temporaries

from lora_sampler import SamplerClient, sweep
from lora_sampler._adapters import storage
from lora_sampler.cli import main
from lora_sampler.errors import PublishError
from lora_sampler.publish import publish_checkpoint
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

#: Seconds a call may run before the test calls it unbounded (its deadlines here are 3-5 s).
BOUND = 60.0
#: The client's timeout in these tests: 1 s to connect, 2 s to answer.
TIMEOUT = (1.0, 2.0)
KEY = "run/step-1.tar.gz"
URL = f"s3://{BUCKET}/{KEY}"


@pytest.fixture
def store(no_aws_account: None, tmp_path: Path) -> Iterator[FaultStore]:
    """A running stand-in holding one adapter archive at ``KEY``; no AWS account or metadata service is asked."""
    import s3fs

    started = FaultStore(drip_interval=0.5)
    archive = tmp_path / "step-1.tar.gz"
    write_adapter_archive(archive, "tiny-base")
    started.objects[KEY] = archive.read_bytes()
    try:
        yield started
    finally:
        started.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def within_bound(call: Callable[[], Any]) -> BaseException:
    """Run ``call`` in a thread; assert it ended within ``BOUND`` seconds by raising; return what it raised."""
    outcome = outcome_within(call, BOUND)
    assert isinstance(outcome, BaseException), f"the call returned {outcome!r} instead of failing"
    return outcome


def client_of(store: FaultStore, engine: FakeEngine, lora_dir: Path) -> SamplerClient:
    return SamplerClient(engine.url, lora_base_dir=lora_dir, timeout=TIMEOUT, storage_options=store.options())


def test_silent_store_is_given_up_at_the_client_timeout(store: FaultStore, engine: FakeEngine, lora_dir: Path) -> None:
    """A store that takes the connection and never answers: the HEAD ends at the client's connect + read timeout."""
    store.faults["HEAD"] = "silent"
    with client_of(store, engine, lora_dir) as client:
        error = within_bound(lambda: client.publish(URL))
    assert isinstance(error, PublishError), error
    assert URL in str(error) and "too slow" in str(error) and "within 3.0 s" in str(error)
    assert count(store, "HEAD") >= 1 and os.listdir(lora_dir) == []


def test_dripping_download_is_cut_at_its_transfer_deadline(
    store: FaultStore, engine: FakeEngine, lora_dir: Path
) -> None:
    """A GET whose body drips a byte per 0.5 s (a1a82fa: 259.7 s for 518 bytes) ends at read timeout + size/rate."""
    store.faults["GET"] = "drip-body"
    with client_of(store, engine, lora_dir) as client:
        error = within_bound(lambda: client.publish(URL))
    assert isinstance(error, PublishError), error
    assert f"the download of {len(store.objects[KEY])} bytes did not end within 3.0 s" in str(error)
    assert "nothing was published" in str(error)
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


def test_store_dripping_its_headers_is_cut_too(store: FaultStore, lora_dir: Path) -> None:
    """Status line and headers dripped a byte at a time: the same deadline, with the options' own timeouts."""
    store.faults["GET"] = "drip"
    options = store.options(config_kwargs={"connect_timeout": 1, "read_timeout": 1})
    error = within_bound(lambda: publish_checkpoint(URL, lora_dir, storage_options=options))
    assert isinstance(error, PublishError) and "within 2.0 s" in str(error), error


def test_dripping_listing_is_cut_at_its_page_deadline(store: FaultStore, lora_dir: Path) -> None:
    """A listing dripped a byte per 0.5 s (a1a82fa: 226 s): the glob and a folder's publish end at the deadline."""
    store.faults["LIST"] = "drip-body"
    options = storage.StorageOptions(store.options(), timeout=TIMEOUT)
    error = within_bound(lambda: storage.expand(f"s3://{BUCKET}/run/*.tar.gz", options))
    assert isinstance(error, PublishError) and "a listing page did not end" in str(error), error
    error = within_bound(lambda: publish_checkpoint(f"s3://{BUCKET}/run/", lora_dir, storage_options=options))
    assert isinstance(error, PublishError) and "a listing page did not end" in str(error), error


def test_listing_that_never_ends_is_refused(store: FaultStore) -> None:
    """A store whose every page says "more" with the same continuation token: refused after the repeat."""
    store.faults["LIST"] = "loop"
    error = within_bound(lambda: storage.list_folder(f"s3://{BUCKET}/run", store.options()))
    assert isinstance(error, PublishError) and "does not end" in str(error), error
    assert count(store, "LIST") == 2


@pytest.mark.parametrize("pattern", [f"s3://{BUCKET}/run/*.tar.gz", f"s3://{BUCKET}/run/"])
def test_listing_whose_pages_never_end_is_cut_at_the_listing_bound(
    store: FaultStore, lora_dir: Path, pattern: str
) -> None:
    """Every page says "more" with a new continuation token (00c7ac5: a glob and a folder publish still listing
    after 60 s and 6,000-11,000 requests): the whole listing stops at ``max_listed_keys`` (one page per 1,000 keys),
    with an error naming the bound and how to raise it."""
    store.faults["LIST"] = "endless"
    options = storage.StorageOptions(store.options(max_listed_keys=5000), timeout=TIMEOUT)
    if pattern.endswith("/"):
        call: Callable[[], Any] = lambda: publish_checkpoint(pattern, lora_dir, storage_options=options)  # noqa: E731
    else:
        call = lambda: storage.expand(pattern, options)  # noqa: E731
    error = within_bound(call)
    assert isinstance(error, PublishError), error
    assert "max_listed_keys=5000" in str(error) and "5 pages" in str(error), error
    assert count(store, "LIST") <= 6
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


def test_default_listing_bound_lists_a_bucket_of_100000_keys_in_full() -> None:
    """The default bound leaves a real bucket of 100,000 keys room to list in full, ten times over."""
    assert storage.DEFAULT_MAX_LISTED_KEYS >= 1_000_000
    assert storage.deadlines({}).listing_pages == storage.DEFAULT_MAX_LISTED_KEYS // 1000


@pytest.fixture
def store_in_environment(store: FaultStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI takes no storage options: the standard variables point the storage library at the stand-in."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.mark.usefixtures("store_in_environment")
def test_cli_publish_timeout_bounds_the_store(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lora-sampler publish --timeout 1,2`` (00c7ac5: no such flag) holds a silent store's HEAD to 3 s, as
    ``SamplerClient(timeout=(1, 2))`` does: the CLI builds its client from the same value."""
    store.faults["HEAD"] = "silent"
    argv = ["publish", URL, "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--timeout", "1,2"]
    status = within_bound(lambda: SystemExit(main(argv)))
    assert isinstance(status, SystemExit) and status.code == 2, status
    err = capsys.readouterr().err
    assert URL in err and "too slow" in err and "within 3.0 s" in err and "--timeout" in err, err
    assert count(store, "HEAD") >= 1 and os.listdir(lora_dir) == []


@pytest.mark.usefixtures("store_in_environment")
def test_cli_max_listed_keys_bounds_a_folder_publish(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-listed-keys 2000`` reaches the store's listing: an endless listing stops after its 2 pages."""
    store.faults["LIST"] = "endless"
    url = f"s3://{BUCKET}/run/"
    argv = ["publish", url, "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--max-listed-keys", "2000"]
    status = within_bound(lambda: SystemExit(main(argv)))
    assert isinstance(status, SystemExit) and status.code == 2, status
    err = capsys.readouterr().err
    assert "max_listed_keys=2000" in err and "--max-listed-keys" in err, err
    assert count(store, "LIST") <= 3 and os.listdir(lora_dir) == []


@pytest.mark.parametrize("fault", ["HEAD silent", "GET drip-body", "LIST endless"])
def test_the_generic_fsspec_path_keeps_the_same_bounds(
    store: FaultStore, lora_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Stores other than S3 (gcsfs) go through fsspec's documented async methods (``_info``, ``_find``, ``_glob``,
    ``_cat_file``) under ``sync(..., timeout=)``: driven through that path here (s3fs's own methods against the
    stand-in), a silent look-up, a dripping download and an endless listing each end at their deadline. The
    timeout is (5, 5) here: on this path the first request's deadline also covers making s3fs's client."""
    monkeypatch.setattr(storage, "_is_s3", lambda fs: False)
    operation, mode = fault.split()
    store.faults[operation] = mode
    options = storage.StorageOptions(store.options(max_listed_keys=2000), timeout=(5.0, 5.0))
    url = f"s3://{BUCKET}/run/" if operation == "LIST" else URL
    error = within_bound(lambda: publish_checkpoint(url, lora_dir, storage_options=options))
    assert isinstance(error, PublishError) and "too slow" in str(error), error
    expected = {
        "HEAD": "the look-up did not end within 10.0 s",
        "GET": f"the download of {len(store.objects[KEY])} bytes did not end within 10.0 s",
        "LIST": "the listing did not end within 23.2 s",
    }
    assert expected[operation] in str(error), error
    assert count(store, operation) >= 1
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


@pytest.mark.usefixtures("store_in_environment")
def test_cli_sweep_over_an_endless_listing_ends_at_the_listing_bound(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lora-sampler sweep`` over a glob whose listing never ends (00c7ac5 with ``--timeout 2,5``: still listing at
    45 s after 8,444 requests, printing nothing) ends with an error naming the bound after its pages."""
    store.faults["LIST"] = "endless"
    inp = tmp_path / "prompts.jsonl"
    inp.write_text('{"id": "a", "prompt": [5, 6]}\n')
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp), "--quiet"]
    argv += ["--output-dir", str(tmp_path / "out"), "--checkpoints", f"s3://{BUCKET}/run/*.tar.gz", "--settle", "0"]
    argv += ["--timeout", "2,5", "--max-listed-keys", "3000"]
    status = within_bound(lambda: SystemExit(main(argv)))
    assert isinstance(status, SystemExit) and status.code != 0, status
    err = capsys.readouterr().err
    assert "max_listed_keys=3000" in err and "--max-listed-keys" in err, err
    assert count(store, "LIST") <= 4 and os.listdir(lora_dir) == []


def test_connection_dropped_midway_publishes_nothing(store: FaultStore, lora_dir: Path) -> None:
    """Half the body, then the connection closes: a PublishError naming the URL; nothing left behind."""
    store.faults["GET"] = "drop"
    error = within_bound(lambda: publish_checkpoint(URL, lora_dir, storage_options=store.options()))
    assert isinstance(error, PublishError) and URL in str(error) and "nothing was published" in str(error)
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


def test_object_changed_after_its_look_up_says_so(store: FaultStore, lora_dir: Path, tmp_path: Path) -> None:
    """Rewritten between HEAD and GET: refused (If-Match), saying it was rewritten, not blaming the endpoint."""
    newer = tmp_path / "newer.tar.gz"
    write_adapter_archive(newer, "tiny-base", rank=4)
    store.changes[KEY] = newer.read_bytes()
    error = within_bound(lambda: publish_checkpoint(URL, lora_dir, storage_options=store.options()))
    assert isinstance(error, PublishError), error
    message = str(error)
    assert URL in message and "rewritten in the store after it was looked up" in message
    assert "Publish it again" in message and "AWS_ENDPOINT_URL" not in message and "endpoint" not in message
    assert os.listdir(lora_dir) == []
    assert publish_checkpoint(URL, lora_dir, storage_options=store.options()).source == URL  # as it says


def test_object_vanished_after_its_look_up_is_named(store: FaultStore, lora_dir: Path) -> None:
    """Deleted between HEAD and GET (a retention policy): a PublishError naming the URL; nothing published."""
    store.changes[KEY] = None
    error = within_bound(lambda: publish_checkpoint(URL, lora_dir, storage_options=store.options()))
    assert isinstance(error, PublishError) and URL in str(error) and "no such object" in str(error), error
    assert os.listdir(lora_dir) == [] and temporaries(lora_dir) == []


def test_unreachable_store_names_the_endpoint(store: FaultStore, lora_dir: Path) -> None:
    """Nothing listening at the endpoint: the message is about reaching the store (where the endpoint advice fits)."""
    options = store.options(config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}})
    store.stop()
    error = within_bound(lambda: publish_checkpoint(URL, lora_dir, storage_options=options))
    assert isinstance(error, PublishError), error
    assert "cannot be reached" in str(error) and "AWS_ENDPOINT_URL" in str(error)


def test_keys_with_double_slashes_are_reported_as_they_are(store: FaultStore, lora_dir: Path) -> None:
    """A key with ``//`` is listed, globbed, published and named under its own URL, never a collapsed one."""
    store.objects["run//step-2.tar.gz"] = store.objects[KEY]
    write_adapter(lora_dir.parent / "folder", "tiny-base")
    for file in sorted((lora_dir.parent / "folder").iterdir()):
        store.objects[f"run//step-3/{file.name}"] = file.read_bytes()
    found = storage.expand(f"s3://{BUCKET}/run//step-*", store.options())
    assert sorted(found) == [f"s3://{BUCKET}/run//step-2.tar.gz", f"s3://{BUCKET}/run//step-3"]
    files = storage.list_folder(f"s3://{BUCKET}/run//step-3", store.options())
    assert {file.url for file in files} == {f"s3://{BUCKET}/run//step-3/{file.rel}" for file in files}
    assert publish_checkpoint(found[0], lora_dir, storage_options=store.options()).source == found[0]
    for file in sorted((lora_dir.parent / "folder").iterdir()):  # an uploader that joined "step-4/" + "/name"
        store.objects[f"run/step-4//{file.name}"] = file.read_bytes()
    files = storage.list_folder(f"s3://{BUCKET}/run/step-4", store.options())
    assert sorted(file.url for file in files) == sorted(f"s3://{BUCKET}/run/step-4//{file.rel}" for file in files)
    assert publish_checkpoint(f"s3://{BUCKET}/run/step-4", lora_dir, storage_options=store.options())
    store.objects[f"run/step-4/{files[0].rel}"] = b"another object for the same file"
    error = within_bound(
        lambda: publish_checkpoint(f"s3://{BUCKET}/run/step-4/", lora_dir, storage_options=store.options())
    )
    assert f"s3://{BUCKET}/run/step-4//{files[0].rel}" in str(error) and "two objects" in str(error), error
    error = within_bound(
        lambda: publish_checkpoint(f"s3://{BUCKET}/run//missing.tar.gz", lora_dir, storage_options=store.options())
    )
    assert f"s3://{BUCKET}/run//missing.tar.gz" in str(error)


@pytest.mark.parametrize("name", ["step 1+(ü)%20#.tar.gz", "step-&<'\">.tar.gz", "step-\u2028x.tgz"])
def test_keys_with_odd_characters_round_trip(store: FaultStore, lora_dir: Path, name: str) -> None:
    """Spaces, ``+``, ``%``, ``#``, XML specials and unicode in a key: globbed and published under that key."""
    store.objects[f"run/{name}"] = store.objects.pop(KEY)
    found = storage.expand(f"s3://{BUCKET}/run/*", store.options())
    assert found == [f"s3://{BUCKET}/run/{name}"]
    assert publish_checkpoint(found[0], lora_dir, storage_options=store.options()).source == found[0]


def test_huge_listing_is_paged_and_a_glob_reads_only_its_level(store: FaultStore) -> None:
    """2,500 checkpoints (each a folder of two objects): a glob of the last segment reads 3 pages, not 5 or more;
    a folder listing follows every page; nothing is lost or repeated."""
    for step in range(2500):
        store.objects[f"big/step-{step}/adapter_config.json"] = b"{}"
        store.objects[f"big/step-{step}/adapter_model.safetensors"] = b"w"
    found = storage.expand(f"s3://{BUCKET}/big/step-*", store.options())
    assert len(found) == len(set(found)) == 2500 and count(store, "LIST") == 3
    files = storage.list_folder(f"s3://{BUCKET}/big", store.options())
    assert len(files) == len({file.rel for file in files}) == 5000


def test_sweep_over_a_dripping_store_records_each_checkpoint_and_ends(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """A sweep whose downloads drip: each checkpoint is recorded with the deadline's error under the client's
    timeout (the sweep's listing and publishing both get it), and the sweep ends; a dripped listing is an error."""
    store.objects["run/step-2.tar.gz"] = store.objects[KEY]
    store.faults["GET"] = "drip-body"
    requests = [{"id": "a", "prompt": [5, 6]}]
    with client_of(store, engine, lora_dir) as client:
        run_sweep = lambda: list(  # noqa: E731
            sweep(client, f"s3://{BUCKET}/run/*.tar.gz", requests, output_dir=tmp_path / "out", settle=0, window=1)
        )
        reports = within_bound_returning(run_sweep, "the sweep")
        assert [report.checkpoint for report in reports] == [URL, f"s3://{BUCKET}/run/step-2.tar.gz"]
        assert all(report.error and "did not end within 3.0 s" in report.error["message"] for report in reports)
        store.faults["LIST"] = "drip-body"
        error = within_bound(run_sweep)
    assert isinstance(error, PublishError) and "a listing page did not end within 4.6 s" in str(error), error


def test_rerun_over_a_silent_store_waits_for_one_change_check_only(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """A finished sweep run again while the store lists but never answers a HEAD: the change check of the first
    checkpoint waits out its deadline, the others are left for the next run, and the sweep ends with every report."""
    for step in (2, 3, 4):
        store.objects[f"run/step-{step}.tar.gz"] = store.objects[KEY]
    requests = [{"id": 0, "prompt": [5, 6]}]
    with client_of(store, engine, lora_dir) as client:
        run_sweep = lambda: list(  # noqa: E731
            sweep(client, f"s3://{BUCKET}/run/*.tar.gz", requests, output_dir=tmp_path / "out", settle=0, window=1)
        )
        first = run_sweep()
        assert [report.error for report in first] == [None] * 4
        store.faults["HEAD"] = "silent"
        before = len(store.requests)
        rerun = within_bound_returning(run_sweep, "the rerun")
    assert [report.checkpoint for report in rerun] == [report.checkpoint for report in first]
    looked_at = {key for operation, key in store.requests[before:] if operation == "HEAD"}
    assert len(looked_at) == 1, looked_at


@pytest.mark.usefixtures("store_in_environment")
def test_cli_sweep_timeout_reaches_a_silent_store(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """``lora-sampler sweep --timeout 1,2`` over a store whose listings never answer ends at that timeout's bound
    with the store named, as the Python sweep and ``sample`` do. On 00c7ac5 the CLI's listing waited the default
    10,300 instead (313.5 s measured): its sweep settings never carried the client's timeout to the store."""
    from lora_sampler.cli import main

    store.faults["LIST"] = "silent"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 0, "prompt": [5, 6]}\n')
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(prompts), "--quiet"]
    argv += ["--output-dir", str(tmp_path / "out"), "--checkpoints", f"s3://{BUCKET}/run/*.tar.gz", "--settle", "0"]
    code = within_bound_returning(lambda: main([*argv, "--timeout", "1,2"]), "the CLI sweep")
    assert code == 2 and count(store, "LIST") >= 1
    with client_of(store, engine, lora_dir) as client:  # the Python sweep, the same client timeout: the same bound
        error = within_bound(
            lambda: list(sweep(client, f"s3://{BUCKET}/run/*.tar.gz", [{"prompt": [5]}], output_dir=tmp_path / "py"))
        )
    assert isinstance(error, PublishError) and "did not end within" in str(error), error


def test_sweep_storage_options_reach_its_listing_and_its_publishing(
    store: FaultStore, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """``sweep(storage_options=...)`` on a client without any: the listing and each checkpoint's download both go to
    that store. Before, only the listing did; the publish used the client's options (none: no endpoint, no
    credentials) and every checkpoint failed."""
    with SamplerClient(engine.url, lora_base_dir=lora_dir, timeout=TIMEOUT) as client:
        reports = within_bound_returning(
            lambda: list(
                sweep(
                    client,
                    f"s3://{BUCKET}/run/*.tar.gz",
                    [{"prompt": [5, 6]}],
                    output_dir=tmp_path / "out",
                    settle=0,
                    storage_options=store.options(),
                )
            )
        )
    assert [(report.checkpoint, report.error, report.rows) for report in reports] == [(URL, None, 1)]
    assert count(store, "LIST") >= 1 and count(store, "GET") >= 1


def within_bound_returning(call: Callable[[], Any], what: str = "the call") -> Any:
    """Run ``call`` in a thread; assert it ended within ``BOUND`` seconds by returning; return what it returned."""
    outcome = outcome_within(call, BOUND, what)
    assert not isinstance(outcome, BaseException), f"{what} raised {outcome!r} instead of returning"
    return outcome
