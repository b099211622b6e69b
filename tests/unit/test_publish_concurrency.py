"""Concurrent publishers (threads and processes) of one checkpoint: all succeed, one folder, no leftovers."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import threading
import time
from typing import List

from lora_sampler import publish
from lora_sampler.publish import MARKER_FILE, publish_checkpoint

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
THREADS = 8
PROCESSES = 4
CONFIG = {"peft_type": "LORA", "base_model_name_or_path": "/models/tiny-model", "r": 8}

# Each child signals it is ready, waits for the go file, publishes, and prints the adapter as JSON.
CHILD = """
import json, os, sys, time
from lora_sampler.publish import publish_checkpoint
archive, base, ready, go = sys.argv[1:5]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
adapter = publish_checkpoint(archive, base)
print(json.dumps({"name": adapter.name, "digest": adapter.digest}))
"""


def build_archive(path: pathlib.Path, weights: bytes) -> pathlib.Path:
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in (
            ("step/adapter_config.json", json.dumps(CONFIG).encode()),
            ("step/adapter_model.safetensors", weights),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def wait_for(paths: List[pathlib.Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "child processes did not start"
        time.sleep(0.01)


def test_publish_concurrent_threads_and_processes(tmp_path: pathlib.Path) -> None:
    """8 threads and 4 processes publishing one 5 MB archive all succeed with one name, one folder, no temporaries."""
    weights = os.urandom(5 << 20)
    archive = build_archive(tmp_path / "step-400.tar.gz", weights)
    base = tmp_path / "loras"
    base.mkdir()
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    readies = [tmp_path / f"ready-{i}" for i in range(PROCESSES)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(archive), str(base), str(ready), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for ready in readies
    ]
    start = threading.Event()
    names: List[str] = []
    errors: List[BaseException] = []

    def publish_in_thread() -> None:
        start.wait()
        try:
            names.append(publish_checkpoint(archive, base).name)
        except BaseException as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=publish_in_thread) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    try:
        wait_for(readies)
    finally:
        go.touch()
        start.set()
    for thread in threads:
        thread.join(timeout=120)
    outputs = [child.communicate(timeout=120) for child in children]
    for child, (_, stderr) in zip(children, outputs):
        assert child.returncode == 0, stderr
    assert errors == []
    names += [json.loads(stdout)["name"] for stdout, _ in outputs]
    assert len(names) == THREADS + PROCESSES
    assert len(set(names)) == 1
    assert os.listdir(base) == [names[0]]  # exactly one folder, no ".tmp-" leftovers
    published = base / names[0]
    assert sorted(os.listdir(published)) == [MARKER_FILE, "adapter_config.json", "adapter_model.safetensors"]
    assert (published / "adapter_model.safetensors").read_bytes() == weights
    assert json.loads((published / "adapter_config.json").read_text()) == CONFIG
    assert publish.read_published_digest(published) == publish.checkpoint_digest(archive)
