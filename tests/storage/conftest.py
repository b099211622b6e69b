"""Fixtures for the storage tests: a real S3 API server (moto) on loopback, dummy credentials, adapter archives.

Where moto, boto3 or s3fs are missing (the default tox envs) every test here skips, and fails in CI
(``tests/_services.py``); ``tox -e storage`` has them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from _s3server import BUCKET, S3Server, boto3_client
from _services import require


@pytest.fixture(autouse=True)
def _storage_packages() -> None:
    """Every storage test needs s3fs (lora_sampler[s3]), moto's server and boto3: skip without them, fail in CI."""
    for module in ("s3fs", "moto", "boto3"):
        require(module, "run these tests with `tox -e storage` (lora_sampler[s3] and moto[server])")


@pytest.fixture
def no_aws_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS profile, endpoint, session, config file or metadata service reaches the storage library, so the
    stand-in's tests (``_faultstore.py``) ask only what they point it at; fsspec's cached filesystems are forgotten."""
    import s3fs

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    """A fresh moto S3 server process on 127.0.0.1 (its own process group), killed after the test."""
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """A boto3 client of the server holding bucket ``ckpts``; the environment points the library at the server.

    Only dummy credentials and the loopback endpoint are set (never a real AWS account): no profile, no shared
    config, no instance-metadata lookups. fsspec's cached filesystems are forgotten so each test sees its server.
    """
    import s3fs

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.client_environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3_client(s3_server.endpoint)
    client.create_bucket(Bucket=BUCKET)
    yield client
    s3fs.S3FileSystem.clear_instance_cache()
