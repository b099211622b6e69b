"""``python -m lora_sampler.testing`` and ``lora-sampler serve-test-engine``: the test engine from the shell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
from test_cli import subprocess_env

from lora_sampler.cli import main
from lora_sampler.testing import write_adapter_archive


def _serve(argv: List[str], tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    "entry", [["-m", "lora_sampler.testing"], ["-m", "lora_sampler", "serve-test-engine"]], ids=["module", "cli"]
)
def test_serve_test_engine_until_ctrl_c(entry: List[str], tmp_path: Path) -> None:
    """It prints its URL, serves the CLI's commands (publish, sample) on its folder, and stops on Ctrl-C with 0."""
    lora_dir = tmp_path / "loras"
    proc = _serve([*entry, "--port", "0", "--lora-dir", str(lora_dir), "--model", "my-base"], tmp_path)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "my-base")
        prompts = tmp_path / "in.jsonl"
        prompts.write_text(json.dumps({"id": 1, "prompt": "hello"}) + "\n")
        out = tmp_path / "out.jsonl"
        argv = ["sample", "--base-url", url, "--lora-base-dir", str(lora_dir), "--adapter", archive, "--quiet"]
        assert main([*argv, "-i", str(prompts), "-o", str(out)]) == 0
        assert json.loads(out.read_text())["sequences"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "resolver folder" in err and "stopped" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lora_dir.is_dir()  # a folder given is kept


def test_serve_test_engine_removes_its_temporary_folder_and_reports_a_taken_port(tmp_path: Path) -> None:
    """Without --lora-dir a temporary folder is made and removed; a port in use is one clear error, exit 2."""
    proc = _serve(["-m", "lora_sampler.testing", "--port", "0"], tmp_path)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip()
        folder = ""
        deadline = time.monotonic() + 10
        while not folder and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "resolver folder:" in line:
                folder = line.split("resolver folder:", 1)[1].split(" (", 1)[0].strip()
        assert os.path.isdir(folder)
        port = url.rsplit(":", 1)[1]
        taken = subprocess.run(
            [sys.executable, "-m", "lora_sampler.testing", "--port", port],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            cwd=tmp_path,
            timeout=30,
        )
        assert taken.returncode == 2 and "serve-test-engine: error:" in taken.stderr and "Traceback" not in taken.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(folder)


def test_visibility_delay_by_stem_hides_the_published_content_name(tmp_path: Path) -> None:
    """set_visibility_delay("step-1") hides step-1-<digest> (what publishing names it), so the race really runs;
    an archive name is refused with the reason."""
    from lora_sampler import RetryPolicy, SamplerClient
    from lora_sampler.testing import FakeEngine

    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), "tiny-base")
    with FakeEngine(lora_dir=lora_dir) as engine:
        engine.set_visibility_delay("step-1", requests=2)
        with pytest.raises(ValueError, match="adapter name"):
            engine.set_visibility_delay("step-1.tar.gz", requests=2)
        policy = RetryPolicy(base_delay=0.001, max_delay=0.002)
        with SamplerClient(engine.url, lora_base_dir=lora_dir, retry=policy) as client:
            output = client.sample([1, 2], adapter=archive)
        assert output.model.startswith("step-1-")
        statuses = [r.status for r in engine.requests if r.path == "/v1/completions"]
        assert statuses[0] == 404 and statuses[-1] == 200, statuses  # raced: hidden at first, then served
