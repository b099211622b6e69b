"""How fast a newcomer's first mistake is reported: a bare adapter name that was never published under that name.

``publish`` names ``step-400.tar.gz`` after its content (``step-400-<digest>``), so ``adapter="step-400"`` names no
adapter. Measured with real retry waits against a ``FakeEngine``, for the library (``client.sample``) and the CLI
(``lora-sampler sample --adapter step-400``, 100 prompt lines), in subprocesses that import the lora_sampler of
``--checkout`` (default: this one), so an older checkout can be measured the same way::

    python benchmarks/bench_first_mistakes.py [--checkout /path/to/other/checkout] [--label before]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import _common  # (also puts the checkout's lora_sampler on sys.path)

from lora_sampler.testing import FakeEngine, write_adapter_archive

COMPLETIONS_PATH = "/v1/completions"
LIBRARY_SCRIPT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from lora_sampler import SamplerClient
started = time.monotonic()
with SamplerClient(sys.argv[1], lora_base_dir=sys.argv[2]) as client:
    client.publish(sys.argv[3])
    try:
        client.sample("Once upon a time", adapter="step-400")
    except Exception as exc:
        print(type(exc).__name__, round(time.monotonic() - started, 2), str(exc)[:300])
"""


def _run(command: List[str], checkout: str, cwd: str) -> Dict[str, Any]:
    env = _common.checkout_env(checkout)
    env.pop("LORA_SAMPLER_TESTING", None)  # real retry waits
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)  # not this folder
    stderr = [line for line in done.stderr.splitlines() if line.strip()]
    return {
        "seconds": round(time.monotonic() - started, 2),
        "exit": done.returncode,
        "stdout": done.stdout.strip()[:400],
        "stderr_lines": len(stderr),
        "retry_lines": sum("Retrying" in line for line in stderr),
        "stderr_head": stderr[:3],
    }


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def measure(checkout: str) -> Dict[str, Any]:
    """Run both mistakes once against a fresh engine; return what each cost."""
    with tempfile.TemporaryDirectory() as work:
        lora_dir = os.path.join(work, "loras")
        os.mkdir(lora_dir)
        with FakeEngine(lora_dir=lora_dir) as engine:
            archive = write_adapter_archive(os.path.join(work, "runs", "exp1", "step-400.tar.gz"), engine.model)
            library = _run([sys.executable, "-S", "-c", LIBRARY_SCRIPT, engine.url, lora_dir, archive], checkout, work)
            library["completions_sent"] = engine.calls(COMPLETIONS_PATH)
            engine.reset_log()
            prompts, output = os.path.join(work, "prompts.jsonl"), os.path.join(work, "out.jsonl")
            with open(prompts, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps({"id": i, "prompt": f"prompt {i}"}) + "\n" for i in range(100))
            argv = ["sample", "--base-url", engine.url, "--lora-base-dir", lora_dir, "--adapter", "step-400"]
            argv += ["--input", prompts, "--output", output, "--quiet"]
            cli = _run([sys.executable, "-S", "-m", "lora_sampler", *argv], checkout, work)
            cli["completions_sent"] = engine.calls(COMPLETIONS_PATH)
            cli["error_rows"] = _lines(output)
    return {"library": library, "cli": cli}


def main() -> None:
    _common.checkout_run("bench_first_mistakes", measure, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
