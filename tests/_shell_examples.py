"""One README or docs shell example run as written against an engine: what every suite that runs them shares.

The default suite runs the unmarked ```bash blocks on the served test engine (``tests/socket/test_docs_shell.py``);
a tox env runs those marked ``<!-- docs-test: tox -e NAME -->`` with the extra it installs. The examples talk to a
vLLM at ``http://127.0.0.1:8000`` whose resolver folder is ``/shared/loras`` (``/tmp/loras`` in the guide that
serves the test engine); both are replaced by the running engine's, since a test never takes a fixed port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

from _markdown import Example

#: What the examples call the engine and its resolver folder.
EXAMPLE_URL = "http://127.0.0.1:8000"
EXAMPLE_LORA_DIRS = ("/shared/loras", "/tmp/loras")
#: Seconds one block may run: each is one short job on a test engine.
BLOCK_SECONDS = 120


def run_shell_example(block: Example, folder: Path, url: str, lora_dir: Path, env: Dict[str, str]) -> None:
    """Run ``block`` with ``bash -e -o pipefail`` in ``folder`` on the engine at ``url``; ``lora-sampler`` is this
    environment's. It passes when it exits 0 with no traceback and every ``--output``, ``-o`` or ``--output-dir`` it
    names was written (a sweep's ``sweep.jsonl``)."""
    script = block.code.replace(EXAMPLE_URL, url)
    for example_dir in EXAMPLE_LORA_DIRS:
        script = script.replace(example_dir, str(lora_dir))
    env = {**env, "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")}
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
    )
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    for flag, name in re.findall(r"(--output-dir|--output|-o) (\S+)", script):
        written = folder / name
        if flag == "--output-dir":
            assert (written / "sweep.jsonl").stat().st_size > 0, f"{block.where}: {name}/sweep.jsonl is empty"
        else:
            assert written.stat().st_size > 0, f"{block.where}: {name} is empty"
