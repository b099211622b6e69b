"""The shell examples of the README and of the documentation (docs/**/*.md) run as written, on the served test engine.

Every ```bash block runs (``_shell_examples.run_shell_example``) in a fresh folder, in order, except those marked on
the line before (see ``tests/_markdown.py``): an install, a vLLM on a GPU, a router over GPU replicas, object
storage, a task from the Hugging Face Hub, the test engine's own serve command (this file serves it so); each says
why, and a block marked ``tox -e NAME`` runs in that env, which installs the extra it needs. The engine is the test
engine served by ``lora-sampler serve-test-engine --port 0``. The folder holds what the examples name:
``runs/exp1/step-200.tar.gz``, ``step-400.tar.gz`` and ``step-500.tar.gz`` (three trainings of the served base
model), ``prompts.jsonl``, ``heldout.jsonl`` (prompts with completions) and ``batch.jsonl`` (an OpenAI batch file).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Tuple

import pytest
from _markdown import examples
from _shell_examples import run_shell_example
from test_cli import subprocess_env

from lora_sampler.testing import write_adapter_archive

BLOCKS = examples("bash")
#: What a skipped shell example may need that the test engine cannot give (its reason names one).
SKIP_NEEDS = ("install", "GPU", "router", "object storage", "Hugging Face Hub", "until Ctrl-C")
#: Training steps whose checkpoints the examples name.
STEPS = (200, 400, 500)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, Path]]:
    """The test engine served as a user serves it, on a free loopback port: its URL and resolver folder."""
    root = tmp_path_factory.mktemp("served")
    lora_dir = root / "loras"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_sampler", "serve-test-engine", "--port", "0", "--lora-dir", str(lora_dir)],
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
    for page in ("cli", "scoring", "batching", "everyday", "sweeps"):
        assert f"docs/guides/{page}.md" in runnable, f"no runnable shell example in docs/guides/{page}.md"


def test_a_skipped_shell_example_needs_more_than_the_test_engine() -> None:
    """A shell example is skipped only for what the served test engine cannot stand in for, and says which: an
    install, a GPU, a router, object storage, the Hub, or serving until Ctrl-C (one that only needs "an engine" runs
    here)."""
    vague = [block.where for block in BLOCKS if block.skip and not any(need in block.skip for need in SKIP_NEEDS)]
    assert vague == [], f"these shell examples are skipped without naming what the test engine cannot give: {vague}"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_shell_example_runs(block: Any, served: Tuple[str, Path], tmp_path: Path) -> None:
    """A README or docs shell example runs on the served test engine (or is marked with why it cannot)."""
    if block.skip:
        pytest.skip(block.skip)
    if block.env:
        pytest.skip(f"runs in tox -e {block.env}")
    url, lora_dir = served
    write_inputs(tmp_path, "tiny-base")
    run_shell_example(block, tmp_path, url, lora_dir, subprocess_env())
