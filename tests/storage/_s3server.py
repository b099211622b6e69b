"""A real S3 API server on loopback for the storage tests and the benchmark: moto's app in its own process group.

``python _s3server.py`` binds 127.0.0.1 on a free port, prints the port on its first line, and serves moto's S3 (and
IAM) API. A thin WSGI layer counts the requests it answers, by method, readable at ``GET /_counts`` (which is not
counted). Killing the process group cuts every open connection, which is how a test drops a download mid-way.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

COUNTS_PATH = "/_counts"
#: The bucket every test's checkpoints go into.
BUCKET = "ckpts"
#: The engine model of the adapters built here (FakeEngine's default).
MODEL = "tiny-base"

#: Dummy credentials of the unauthenticated phase (moto accepts any key until auth is switched on).
DUMMY_KEY = "testing"


class CountingApp:
    """WSGI middleware counting the requests the wrapped app answers, by method; ``GET /_counts`` reads them."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def __call__(self, environ: Dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self._lock:
                body = json.dumps(dict(self._counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        with self._lock:
            self._counts[environ.get("REQUEST_METHOD", "?")] += 1
        return self._app(environ, start_response)  # type: ignore[no-any-return]


def serve() -> None:
    """Serve moto on 127.0.0.1 (port 0) until killed; print the port first."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, CountingApp(DomainDispatcherApplication(create_backend_app)), threaded=True)
    print(server.server_port, flush=True)
    server.serve_forever()


class S3Server:
    """A running ``serve()`` process (its own process group); ``stop`` kills the group and waits for it."""

    def __init__(self) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=DUMMY_KEY, AWS_SECRET_ACCESS_KEY=DUMMY_KEY)
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the moto server did not start (said {line!r})")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def client_environment(self) -> Dict[str, str]:
        """Return the variables that point a storage library at this server: dummy keys, the loopback endpoint, and
        no instance-metadata lookups (never a real AWS account)."""
        return {
            "AWS_ACCESS_KEY_ID": DUMMY_KEY,
            "AWS_SECRET_ACCESS_KEY": DUMMY_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def counts(self) -> Dict[str, int]:
        """Return the requests answered so far, by method."""
        with urllib.request.urlopen(self.endpoint + COUNTS_PATH, timeout=10) as answer:
            return json.loads(answer.read())  # type: ignore[no-any-return]

    def requests(self) -> int:
        """Return how many requests the server answered so far."""
        return sum(self.counts().values())

    def enforce_auth(self) -> None:
        """From now on, every request must be signed with a key moto's IAM knows (``make_user``)."""
        request = urllib.request.Request(
            self.endpoint + "/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stop(self) -> None:
        """Kill the server's process group (every open connection drops) and reap it."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it died on its own
                os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def boto3_client(endpoint: str, service: str = "s3", key: str = DUMMY_KEY, secret: Optional[str] = None) -> Any:
    """Return a boto3 client of ``service`` talking to the loopback server."""
    import boto3

    return boto3.client(
        service,
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret or key,
        region_name="us-east-1",
    )


def make_user(endpoint: str) -> List[str]:
    """Create an IAM user allowed everything; return its ``[access key id, secret]`` (before ``enforce_auth``)."""
    iam = boto3_client(endpoint, "iam")
    iam.create_user(UserName="evaluator")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="evaluator", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="evaluator")["AccessKey"]
    return [key["AccessKeyId"], key["SecretAccessKey"]]


def build_archive(folder: Path, stem: str, *, model: str = MODEL, padding: int = 0) -> Path:
    """Write ``<stem>.tar.gz`` of an adapter folder for ``model``; ``padding`` adds that many random bytes."""
    from lora_sampler.testing import write_adapter

    source = folder / "src" / stem
    write_adapter(source, model)
    if padding:
        (source / "padding.bin").write_bytes(os.urandom(padding))
    archive = folder / f"{stem}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=stem)
    return archive


def temporaries(lora_dir: Path) -> List[str]:
    """The dotted temporary folders left in ``lora_dir``."""
    return [entry.name for entry in lora_dir.iterdir() if entry.name.startswith(".")]


if __name__ == "__main__":
    serve()
