"""A checkpoint sweep over storage URLs (see docs/guides/sweeps.md): an s3:// pattern, and a manifest in the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import pytest
from _s3server import BUCKET, S3Server
from test_storage_publish import delta

from lora_sampler import SamplerClient, sweep
from lora_sampler._adapters import storage
from lora_sampler.batch import Manifest
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive

STEPS = (3, 20, 100)


def upload_run(s3: Any, folder: Path, model: str) -> List[str]:
    """Upload ``run1/step-N.tar.gz`` for each step (distinct weights); return their URLs in step order."""
    urls = []
    for index, step in enumerate(STEPS):
        archive = write_adapter_archive(str(folder / f"step-{step}.tar.gz"), model, rank=1 + index)
        s3.upload_file(archive, BUCKET, f"run1/step-{step}.tar.gz")
        urls.append(f"s3://{BUCKET}/run1/step-{step}.tar.gz")
    return urls


def ledger(out: Path) -> List[Any]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def test_storage_sweep_over_an_s3_pattern(
    s3: Any, engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """lora-sampler sweep --checkpoints 's3://.../step-*.tar.gz': natural order, every row once, URLs in the ledger."""
    urls = upload_run(s3, tmp_path, engine.model)
    s3.put_object(Bucket=BUCKET, Key="run1/step-7.txt", Body=b"not a checkpoint")
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"id": f"p{n}", "prompt": [5, n]}) + "\n" for n in range(6)))
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp)]
    argv += ["--output-dir", str(out), "--checkpoints", f"s3://{BUCKET}/run1/step-*.tar.gz", "--window", "1"]
    assert main([*argv, "--settle", "0", "--quiet"]) == 0
    lines = ledger(out)
    assert [(line["checkpoint"], line["step"]) for line in lines] == list(zip(urls, STEPS))
    assert all(line["rows"] == 6 and line["failed"] == 0 for line in lines)
    assert all(line["adapter"].startswith(f"step-{step}-") for line, step in zip(lines, STEPS))
    assert main([*argv, "--settle", "0", "--quiet"]) == 0  # resumed: nothing left to do
    assert len(ledger(out)) == 3


def test_storage_sweep_reads_a_manifest_in_the_store(
    s3: Any, engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A manifest in the store (client and CLI): relative paths are keys beside it, taken in file order."""
    urls = upload_run(s3, tmp_path, engine.model)
    lines = [
        {"name": "last", "batch": 100, "sampler_path": "step-100.tar.gz"},
        {"name": "state", "batch": 100, "state_path": "tinker://state"},
        {"name": "first", "batch": 3, "sampler_path": urls[0], "final": True},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    s3.put_object(Bucket=BUCKET, Key="run1/checkpoints.jsonl", Body=body)
    requests = [{"id": "a", "prompt": [5, 6]}]
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        manifest = Manifest(f"s3://{BUCKET}/run1/checkpoints.jsonl")
        reports = list(sweep(client, manifest, requests, output_dir=tmp_path / "out", window=1, settle=0))
    assert [(r.checkpoint, r.step) for r in reports] == [(urls[2], 100), (urls[0], 3)]
    assert all(r.ok and r.rows == 1 for r in reports)
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "cli-out"
    inp.write_text(json.dumps({"id": "a", "prompt": [5, 6]}) + "\n")
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp), "--quiet"]
    # --window 1: the ledger lists checkpoints as they finish, so two at once could finish in either order.
    assert main([*argv, "--output-dir", str(out), "--manifest", manifest.path, "--settle", "0", "--window", "1"]) == 0
    assert [line["checkpoint"] for line in ledger(out)] == [urls[2], urls[0]]


def test_storage_sweep_evaluates_an_overwritten_object_again(
    s3: Any, engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """An object overwritten with other weights after its sweep (a new ETag) is evaluated again under its new
    content name, its line naming the old adapter in ``replaces``; an unchanged store adds nothing."""
    urls = upload_run(s3, tmp_path, engine.model)
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"id": n, "prompt": [5, n]}) + "\n" for n in range(4)))
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp), "--quiet"]
    argv += ["--output-dir", str(out), "--checkpoints", f"s3://{BUCKET}/run1/step-*.tar.gz", "--settle", "0"]
    assert main(argv) == 0
    first = ledger(out)
    assert len(first) == 3 and all(line["signature"] for line in first)
    step_20 = next(line for line in first if line["checkpoint"] == urls[1])  # lines come as checkpoints finish
    assert main(argv) == 0 and len(ledger(out)) == 3  # same objects: nothing again

    other = write_adapter_archive(str(tmp_path / "retrained.tar.gz"), engine.model, rank=8)
    s3.upload_file(other, BUCKET, "run1/step-20.tar.gz")
    assert main(argv) == 0
    lines = ledger(out)
    assert len(lines) == 4
    again = lines[3]
    assert again["checkpoint"] == urls[1] and again["replaces"] == step_20["adapter"]
    assert again["adapter"] != step_20["adapter"] and again["adapter"].startswith("step-20-")
    assert again["rows"] == 4 and again["failed"] == 0 and again["signature"] != step_20["signature"]
    assert main(argv) == 0 and len(ledger(out)) == 4  # the new content is done: nothing again


def test_storage_sweep_hands_out_an_object_after_one_look_up(
    s3: Any, s3_server: S3Server, engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A stored object is handed out on the look-up that found it settled (its ledger signature is taken from it,
    the store is not asked again): three HEADs in all (four before), that look-up, publish's, and the change check
    of the listing that ends the sweep."""
    archive = write_adapter_archive(str(tmp_path / "step-3.tar.gz"), engine.model, rank=1)
    s3.upload_file(archive, BUCKET, "run1/step-3.tar.gz")
    requests = [{"id": "a", "prompt": [5, 6]}]
    before = s3_server.counts()
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        pattern = f"s3://{BUCKET}/run1/step-*.tar.gz"
        reports = list(sweep(client, pattern, requests, output_dir=tmp_path / "out", window=1, settle=0))
    after = s3_server.counts()
    assert [report.ok for report in reports] == [True] and reports[0].signature
    assert delta(before, after)["HEAD"] == 3


def test_storage_manifest_poll_is_one_get(s3: Any, s3_server: S3Server) -> None:
    """A manifest in the store is read with one GET a poll (its Content-Length sets the download's deadline), and a
    manifest not written yet is a FileNotFoundError (a watch waits for it) after one GET too."""
    body = b'{"sampler_path": "step-3.tar.gz"}\n'
    s3.put_object(Bucket=BUCKET, Key="run1/checkpoints.jsonl", Body=body)
    before = s3_server.counts()
    assert storage.read_bytes(f"s3://{BUCKET}/run1/checkpoints.jsonl") == body
    middle = s3_server.counts()
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"s3://{BUCKET}/run1/later.jsonl")
    after = s3_server.counts()
    assert delta(before, middle) == delta(middle, after) == {"GET": 1}


def test_storage_empty_prefix_is_listed_once(s3: Any, s3_server: S3Server) -> None:
    """A prefix that holds only a console's folder placeholder (``step-5/``) is a folder with no files yet: its one
    listing already said so, so the look-up that follows (which finds the folder) does not list it a second time."""
    s3.put_object(Bucket=BUCKET, Key="run1/step-5/", Body=b"")
    url = f"s3://{BUCKET}/run1/step-5"
    storage.look_up(url)  # a first call opens the storage client
    before = s3_server.counts()
    stored, files = storage.look_up(url)
    after = s3_server.counts()
    assert stored.is_folder and files == []
    listings = delta(before, after).get("GET", 0)
    assert listings == 2, delta(before, after)  # our listing, and the one s3fs's look-up makes of a prefix
