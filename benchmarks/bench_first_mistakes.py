"""How fast a newcomer's first mistakes are reported, and what a failed batch keeps.

Mistakes with adapter names against a ``FakeEngine`` with real retry waits: ``publish`` names ``step-400.tar.gz``
after its content (``step-400-<digest>``), so ``adapter="step-400"`` (the stem), ``"step-40"`` (a typo) and
``"step-400-<digest, last character wrong>"`` name no adapter. Each is measured for the library (``client.sample``)
and the CLI (``lora-sampler sample --adapter NAME``, 100 prompt lines): time, completions sent, stderr lines, and
whether the error says "did you mean". Then the batch error: ``sample_many`` over 200 prompts of which one is
longer than the context; how many answers the raised error still carries (``.results``). Children import the
lora_sampler of ``--checkout`` (default: this one), so an older checkout is measured the same way::

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

from lora_sampler._adapters.publish import publish_checkpoint
from lora_sampler.testing import FakeEngine, write_adapter_archive

COMPLETIONS_PATH = "/v1/completions"
LIBRARY_SCRIPT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from lora_sampler import SamplerClient
started = time.monotonic()
with SamplerClient(sys.argv[1], lora_base_dir=sys.argv[2]) as client:
    try:
        client.sample("Once upon a time", adapter=sys.argv[3])
    except Exception as exc:
        print(type(exc).__name__, round(time.monotonic() - started, 2), str(exc)[:600])
"""
BATCH_SCRIPT = """
import sys, time
from lora_sampler import SamplerClient
requests = [{"prompt": [5] * (300 if i == 150 else 3), "base_model": sys.argv[2], "max_tokens": 4} for i in range(200)]
started = time.monotonic()
with SamplerClient(sys.argv[1], max_workers=8) as client:
    try:
        client.sample_many(requests)
    except Exception as exc:
        kept = [r for r in (getattr(exc, "results", None) or []) if r is not None]
        print(type(exc).__name__, round(time.monotonic() - started, 2), len(kept))
"""
#: The mistakes measured: a label and the adapter name typed, from the published content name.
MISTAKES = {
    "stem": lambda published: "step-400",
    "typo": lambda published: "step-40",
    "digest": lambda published: published[:-1] + ("0" if published[-1] != "0" else "1"),
}


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


def _mistake(engine: FakeEngine, checkout: str, work: str, lora_dir: str, name: str) -> Dict[str, Any]:
    """One mistyped name through the library and the CLI."""
    engine.reset_log()
    library = _run([sys.executable, "-S", "-c", LIBRARY_SCRIPT, engine.url, lora_dir, name], checkout, work)
    library["completions_sent"] = engine.calls(COMPLETIONS_PATH)
    library["did_you_mean"] = "did you mean" in library["stdout"]
    engine.reset_log()
    prompts, output = os.path.join(work, "prompts.jsonl"), os.path.join(work, f"out-{name}.jsonl")
    with open(prompts, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"id": i, "prompt": f"prompt {i}"}) + "\n" for i in range(100))
    argv = ["sample", "--base-url", engine.url, "--lora-base-dir", lora_dir, "--adapter", name]
    argv += ["--input", prompts, "--output", output, "--quiet"]
    cli = _run([sys.executable, "-S", "-m", "lora_sampler", *argv], checkout, work)
    cli["completions_sent"] = engine.calls(COMPLETIONS_PATH)
    cli["error_rows"] = _lines(output)
    cli["did_you_mean"] = any("did you mean" in line for line in cli.pop("stderr_head"))
    return {"name": name, "library": library, "cli": cli}


def measure(checkout: str) -> Dict[str, Any]:
    """Run each mistake once against a fresh engine, then the batch error; return what each cost and kept."""
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        lora_dir = os.path.join(work, "loras")
        os.mkdir(lora_dir)
        with FakeEngine(lora_dir=lora_dir) as engine:
            archive = write_adapter_archive(os.path.join(work, "runs", "exp1", "step-400.tar.gz"), engine.model)
            published = publish_checkpoint(archive, lora_dir).name
            for label, typed in MISTAKES.items():
                results[label] = _mistake(engine, checkout, work, lora_dir, typed(published))
            batch = _run([sys.executable, "-S", "-c", BATCH_SCRIPT, engine.url, engine.model], checkout, work)
            kind, seconds, kept = [*batch["stdout"].split(), "?", "?", "0"][:3]
            results["batch_error"] = {"prompts": 200, "error": kind, "seconds": seconds, "answers_kept": int(kept)}
    return results


def main() -> None:
    _common.checkout_run("bench_first_mistakes", measure, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
