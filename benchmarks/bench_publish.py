"""Publishing a large adapter archive versus a plain ``tarfile`` extract of it (SPEC §8).

Builds an archive of random weights in a temporary folder, then measures, alternating within each round:
a plain ``tarfile`` extract; ``publish_checkpoint`` cold (digest cache cleared, new target folder), with and without
fsync; and ``publish_checkpoint`` again with the digest cached into a folder that already holds it (the fast path).
Targets from the issue: cold <= 1.3x plain extract, cached ~ 0.

    python benchmarks/bench_publish.py [--size-mb 200 --rounds 3 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import _common  # puts the checkout first on sys.path

from lora_sampler import publish

ENGINE_MODEL = "bench/base-model"
#: Target from the issue: a cold publish costs at most this many plain extracts.
COLD_TARGET_RATIO = 1.3
#: "Cached ~ 0": a fast-path publish costs less than this fraction of a plain extract.
CACHED_TARGET_RATIO = 0.01
PLAIN, COLD, COLD_NO_FSYNC, CACHED = "plain extract", "publish cold", "publish cold, no fsync", "publish cached"


def build_archive(folder: str, size_mb: int) -> str:
    """Write an adapter folder with ``size_mb`` MiB of random weights and return its .tar.gz."""
    adapter = os.path.join(folder, "step-400")
    os.makedirs(adapter)
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": ENGINE_MODEL, "r": 8}, f)
    with open(os.path.join(adapter, "adapter_model.safetensors"), "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    archive = os.path.join(folder, "step-400.tar.gz")
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(adapter, arcname="step-400")
    shutil.rmtree(adapter)
    return archive


def plain_extract(archive: str, dest: str) -> None:
    """Extract the way a user would without lora_sampler."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without the extraction filters
            tar.extractall(dest)


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def publish_cold(archive: str, base: str, durable: bool) -> float:
    """Time one publish into a new folder with the digest cache cleared."""
    os.makedirs(base)
    publish.clear_digest_cache()
    publish.DEFAULT_DURABLE = durable
    try:
        return timed(partial(publish.publish_checkpoint, archive, base))
    finally:
        publish.DEFAULT_DURABLE = True
        shutil.rmtree(base)


def run(size_mb: int, rounds: int, workdir: Optional[str]) -> Dict[str, Any]:
    """Run the rounds, alternating the cases, and return the results (seconds per case, medians, ratios)."""
    root = tempfile.mkdtemp(prefix="bench-publish-", dir=workdir)
    try:
        archive = build_archive(root, size_mb)
        warm = os.path.join(root, "warm")
        os.makedirs(warm)
        publish.publish_checkpoint(archive, warm)  # fills the digest cache and the fast-path target
        samples: Dict[str, List[float]] = {PLAIN: [], COLD: [], COLD_NO_FSYNC: [], CACHED: []}
        for round_number in range(rounds):
            dest = os.path.join(root, f"plain-{round_number}")
            samples[PLAIN].append(timed(partial(plain_extract, archive, dest)))
            shutil.rmtree(dest)
            samples[COLD].append(publish_cold(archive, os.path.join(root, f"cold-{round_number}"), True))
            samples[COLD_NO_FSYNC].append(publish_cold(archive, os.path.join(root, f"nofsync-{round_number}"), False))
            publish.checkpoint_digest(archive)  # the cold cases cleared the cache
            samples[CACHED].append(timed(partial(publish.publish_checkpoint, archive, warm)))
        archive_bytes = os.path.getsize(archive)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {case: _common.median(values) for case, values in samples.items()}
    ratios = {case: value / medians[PLAIN] for case, value in medians.items()}
    return {
        "benchmark": "publish",
        "stamp": _common.stamp(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _common.machine(),
        "size_mb": size_mb,
        "archive_bytes": archive_bytes,
        "rounds": rounds,
        "samples_s": samples,
        "median_s": medians,
        "ratio_to_plain_extract": ratios,
        "targets": {
            f"cold <= {COLD_TARGET_RATIO}x plain extract": ratios[COLD] <= COLD_TARGET_RATIO,
            f"cached < {CACHED_TARGET_RATIO}x plain extract": ratios[CACHED] < CACHED_TARGET_RATIO,
        },
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200, help="size of the random weights in MiB (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each case (default 3)")
    parser.add_argument("--json", help="write the results here (default: benchmarks/results/publish.json)")
    parser.add_argument("--workdir", help="folder for the archive and targets (default: the system temp folder)")
    args = parser.parse_args(argv)
    result = run(args.size_mb, args.rounds, args.workdir)
    print(f"{args.size_mb} MiB of random weights, {args.rounds} rounds; {_common.describe_machine(result['machine'])}")
    medians, ratios = result["median_s"], result["ratio_to_plain_extract"]
    rows = [[case, medians[case] * 1000, ratios[case]] for case in medians]
    print(_common.table(["case", "median ms", "x plain extract"], rows))
    for target, ok in result["targets"].items():
        print(f"{_common.verdict(ok)}  {target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.json}")
    else:
        print(f"results: {_common.write_results('publish', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
