"""Storage URLs through the client and the CLI against FakeEngine and a loopback S3 server (moto)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, List

import pytest
from _s3server import BUCKET, S3Server, build_archive

from lora_sampler import SamplerClient
from lora_sampler.cli import main
from lora_sampler.publish import default_adapter_name
from lora_sampler.testing import FakeEngine

URL = f"s3://{BUCKET}/run1/step-400.tar.gz"

pytestmark = pytest.mark.usefixtures("no_waits")


def test_storage_sample_publishes_the_url_on_first_use(
    s3: Any, s3_server: S3Server, engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """Eight threads sample adapter="s3://..." at once through the race: one download, one folder, all answered."""
    archive = build_archive(tmp_path, "step-400", model=engine.model)
    s3.upload_file(str(archive), BUCKET, "run1/step-400.tar.gz")
    name = default_adapter_name(archive)  # the same bytes get the same name from storage
    engine.set_visibility_delay(name, requests=4)  # the resolver does not see the folder for the first 4 tries
    before = s3_server.counts()
    outputs: List[Any] = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        threads = [
            threading.Thread(target=lambda: outputs.append(client.sample([1, 2], adapter=URL))) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        again = client.sample([3], adapter=URL)
    assert len(outputs) == 8 and all(output.sequences for output in outputs) and again.sequences
    assert [entry.name for entry in lora_dir.iterdir()] == [name]
    assert s3_server.counts()["GET"] - before.get("GET", 0) == 1
    assert engine.calls("/v1/completions", model=name) > 9  # the race really happened, and was ridden out


def test_storage_client_passes_storage_options(
    s3: Any, s3_server: S3Server, engine: FakeEngine, lora_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SamplerClient(storage_options=...) reaches the store: the endpoint given there wins over a dead one in env."""
    s3.upload_file(str(build_archive(tmp_path, "step-400", model=engine.model)), BUCKET, "run1/step-400.tar.gz")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    options = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    with SamplerClient(engine.url, lora_base_dir=lora_dir, storage_options=options) as client:
        adapter = client.publish(URL)
    assert adapter.source == URL and (lora_dir / adapter.name).is_dir()


def test_storage_cli_publish_and_sample_take_urls(
    s3: Any, s3_server: S3Server, engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lora-sampler publish s3://... prints the name; a second run costs one HEAD; sample --adapter s3://... answers."""
    s3.upload_file(str(build_archive(tmp_path, "step-400", model=engine.model)), BUCKET, "run1/step-400.tar.gz")
    flags = ["--base-url", engine.url, "--lora-base-dir", str(lora_dir)]
    assert main(["publish", URL, *flags]) == 0
    name = capsys.readouterr().out.strip()
    assert name.startswith("step-400-") and (lora_dir / name / "adapter_config.json").is_file()
    before = s3_server.counts()
    assert main(["publish", URL, *flags]) == 0
    assert capsys.readouterr().out.strip() == name
    after = s3_server.counts()
    assert {m: after[m] - before.get(m, 0) for m in after if after[m] != before.get(m, 0)} == {"HEAD": 1}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{n}", "prompt": [5, n]}) + "\n" for n in range(5)))
    args = ["sample", *flags, "--adapter", URL, "--input", str(inp), "--output", str(out), "--quiet"]
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [f"p{n}" for n in range(5)] and all("error" not in r for r in records)
    assert [entry.name for entry in lora_dir.iterdir()] == [name]


def test_storage_cli_missing_object_exits_2(
    s3: Any, engine: FakeEngine, lora_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sample --adapter with a missing key exits 2 naming the URL, before any completion."""
    missing = f"s3://{BUCKET}/run1/missing.tar.gz"
    flags = ["--base-url", engine.url, "--lora-base-dir", str(lora_dir)]
    assert main(["publish", missing, *flags]) == 2
    assert missing in capsys.readouterr().err
    assert engine.calls("/v1/completions") == 0


def test_storage_cli_doctor_probes_the_url(
    s3: Any, engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """doctor --adapter s3://... reports the object found (one metadata request), and a missing key as a problem."""
    s3.upload_file(str(build_archive(tmp_path, "step-400", model=engine.model)), BUCKET, "run1/step-400.tar.gz")
    flags = ["doctor", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter"]
    assert main([*flags, URL]) == 0
    assert f"{URL}: an object of" in capsys.readouterr().out
    missing = f"s3://{BUCKET}/run1/missing.tar.gz"
    assert main([*flags, missing]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1 and missing in problems[0]
