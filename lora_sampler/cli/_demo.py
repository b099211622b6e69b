"""``lora-sampler demo``: the batch job end to end on the built-in test engine, adapter-load race included.

Starts a ``FakeEngine`` on a free loopback port, builds a small adapter archive, hides it from the engine for its
first few requests (a lagging shared filesystem), samples a handful of prompts through ``lora-sampler sample``
and prints what came back. No network, no arguments, a few seconds.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, List

from lora_sampler._adapters.publish import default_adapter_name
from lora_sampler._wire.routes import COMPLETIONS_PATH, LOAD_ADAPTER_PATH
from lora_sampler.testing import FakeEngine, write_adapter_archive

#: Completions for the adapter the engine answers 404 before it sees the published folder.
DEMO_LAG_REQUESTS = 3
DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    [1, 300, 301, 302, 303],
    "Once upon a time",
    "LoRA adapters are",
    [1, 42, 43, 44],
]


def run_demo(sample: Callable[[List[str]], int]) -> int:
    """Run the demo; return the exit status of the batch.

    Args:
        sample: Runs ``lora-sampler sample`` with these arguments and returns its exit status.
    """
    with tempfile.TemporaryDirectory(prefix="lora-sampler-demo-") as root:
        lora_dir = os.path.join(root, "loras")
        os.mkdir(lora_dir)
        prompts = os.path.join(root, "prompts.jsonl")
        results = os.path.join(root, "results.jsonl")
        with open(prompts, "w", encoding="utf-8") as f:
            for number, prompt in enumerate(DEMO_PROMPTS, 1):
                f.write(json.dumps({"id": f"p{number}", "prompt": prompt}) + "\n")
        with FakeEngine(lora_dir=lora_dir, latency=0.01) as engine:
            archive = write_adapter_archive(os.path.join(root, "step-100.tar.gz"), engine.model, rank=4)
            name = default_adapter_name(archive)
            engine.set_visibility_delay(name, requests=DEMO_LAG_REQUESTS)
            print(f"demo: test engine serving {engine.model!r} at {engine.url}")
            print(f"demo: adapter {name}, hidden from the engine for its first {DEMO_LAG_REQUESTS} requests")
            flags = ["--base-url", engine.url, "--lora-base-dir", lora_dir, "--adapter", archive, "--concurrency", "4"]
            status = sample([*flags, "-i", prompts, "-o", results, "--ordered", "--max-tokens", "8", "--seed", "0"])
            failed_attempts = sum(
                1 for r in engine.requests if r.path == COMPLETIONS_PATH and r.model == name and r.status != 200
            )
            loads = engine.calls(LOAD_ADAPTER_PATH, name)
        with open(results, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if "error" in record:
                    print(f"{record['id']}: error: {record['error']['message']}")
                else:
                    text = record["sequences"][0]["text"]
                    print(f"{record['id']}: {len(record['sequences'][0]['tokens'])} tokens: {text[:60]!r}")
    print(
        f"demo: {len(DEMO_PROMPTS)} prompts, {failed_attempts} retries through the load race, "
        f"{loads} load call{'s' if loads != 1 else ''}"
    )
    return status
