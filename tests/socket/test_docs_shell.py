"""The shell examples of the README and of the documentation (docs/**/*.md) run as written, on the served test engine.

Every ```bash block runs with ``bash -e`` in a fresh folder, in order, except those marked on the line before (see
``tests/_markdown.py``; an install, a vLLM on a GPU, a router, a watch that follows a run for an hour). The
examples talk to a vLLM at ``http://127.0.0.1:8000`` whose resolver folder is ``/shared/loras``: here that engine is
the test engine served by ``python -m lora_sampler.testing --port 0`` (a test never takes a fixed port, so the
block's URL and folder are replaced by the served engine's), and ``lora-sampler`` is this environment's. The
folder holds what the examples name: ``runs/exp1/step-200.tar.gz``, ``step-400.tar.gz`` and ``step-500.tar.gz``
(three trainings of the served base model), ``prompts.jsonl``, ``heldout.jsonl`` (prompts with completions) and
``batch.jsonl`` (an OpenAI batch file). A block passes when it exits 0 with no traceback and every ``--output`` or
``--output-dir`` it names was written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Tuple

import pytest
from _markdown import examples
from test_cli import subprocess_env

from lora_sampler.testing import write_adapter_archive

BLOCKS = examples("bash")
#: What the examples call the engine and its resolver folder.
EXAMPLE_URL = "http://127.0.0.1:8000"
EXAMPLE_LORA_DIR = "/shared/loras"
#: Seconds one block may run: each is one short job on the test engine.
BLOCK_SECONDS = 120
#: Training steps whose checkpoints the examples name.
STEPS = (200, 400, 500)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, Path]]:
    """The test engine served as a user serves it, on a free loopback port: its URL and resolver folder."""
    root = tmp_path_factory.mktemp("served")
    lora_dir = root / "loras"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_sampler.testing", "--port", "0", "--lora-dir", str(lora_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=subprocess_env(),
        cwd=root,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"the test engine did not print its URL: {url!r}"
        yield url, lora_dir
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_inputs(folder: Path, model: str) -> None:
    """The files the examples name, in ``folder``."""
    for rank, step in enumerate(STEPS, 1):
        write_adapter_archive(str(folder / "runs" / "exp1" / f"step-{step}.tar.gz"), model, rank=rank)
    lines = [{"id": n, "prompt": f"Question {n}:"} for n in range(4)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    scored = [{"id": f"q{n}", "prompt": f"Q: {n}+{n}? A:", "completion": f" {2 * n}"} for n in range(4)]
    (folder / "heldout.jsonl").write_text("".join(json.dumps(line) + "\n" for line in scored))
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 8}
    completion = {"model": model, "prompt": "Once upon a time", "max_tokens": 8}
    batch = [
        {"custom_id": "q-17", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "q-18", "method": "POST", "url": "/v1/completions", "body": completion},
    ]
    (folder / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in batch))


def test_readme_and_docs_have_shell_examples_that_run() -> None:
    """The README's command-line example runs here, and so does one of each command-line guide."""
    runnable = {block.where.rsplit(":", 1)[0] for block in BLOCKS if not (block.skip or block.env)}
    assert "README.md" in runnable
    for page in ("cli", "scoring", "batching", "everyday"):
        assert f"docs/guides/{page}.md" in runnable, f"no runnable shell example in docs/guides/{page}.md"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_shell_example_runs(block: Any, served: Tuple[str, Path], tmp_path: Path) -> None:
    """A README or docs shell example runs on the served test engine (or is marked with why it cannot)."""
    if block.skip:
        pytest.skip(block.skip)
    if block.env:
        pytest.skip(f"runs in tox -e {block.env}")
    url, lora_dir = served
    write_inputs(tmp_path, "tiny-base")
    script = block.code.replace(EXAMPLE_URL, url).replace(EXAMPLE_LORA_DIR, str(lora_dir))
    env = subprocess_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
    )
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    for flag, name in re.findall(r"(--output-dir|--output|-o) (\S+)", script):
        written = tmp_path / name
        if flag == "--output-dir":
            assert (written / "sweep.jsonl").stat().st_size > 0, f"{block.where}: {name}/sweep.jsonl is empty"
        else:
            assert written.stat().st_size > 0, f"{block.where}: {name} is empty"
