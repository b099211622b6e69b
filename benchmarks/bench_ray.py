"""Rows/s of a batch job through Ray Data (``lora_sampler.ray_data.run_file``) against the plain CLI, one machine.

Both run the same JSONL file of prompts against one canned engine (``_canned_engine.py``, 20 ms service time) with
the same number of requests in flight: ``lora-sampler sample --concurrency 16`` (a process of its own, timed from
start to exit) against ``run_file`` with 2 actors x 8 threads on a local Ray (timed per run; ``ray.init`` is timed
once, on its own). The contenders alternate, several rounds; medians and the ratio are reported.

Ray runs on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set before Ray is imported), with its token
auth off, its HOME and temp folder in a scratch folder that is removed at the end. Needs ``lora_sampler[ray]``.

    python benchmarks/bench_ray.py [--quick] [--rounds 3] [--rows 2000] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import _common

MODEL = "bench/base-model"
CONTENDERS = ("cli", "ray")
CONCURRENCY = 16
ACTORS = 2


def write_prompts(path: str, rows: int) -> None:
    """Write ``rows`` JSONL prompts with ids."""
    with open(path, "w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"id": i, "prompt": [1, 450, 4996, i % 1000 + 10]}) + "\n")


def run_cli(url: str, source: str, target: str, env: Dict[str, str]) -> float:
    """Run ``lora-sampler sample`` in its own process; return its wall time."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)  # a fresh run, not a resume
    argv = [sys.executable, "-m", "lora_sampler", "sample", "--base-url", url, "--base-model", MODEL]
    argv += ["--input", source, "--output", target, "--concurrency", str(CONCURRENCY), "--quiet"]
    started = time.perf_counter()
    subprocess.run(argv, check=True, env=env, start_new_session=True)
    return time.perf_counter() - started


def run_ray(url: str, source: str, target: str) -> float:
    """Run ``run_file`` over the local Ray; return its wall time."""
    from lora_sampler.ray_data import ClientSettings, run_file

    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    settings = ClientSettings(url, max_workers=CONCURRENCY // ACTORS, timeout=(30.0, 30.0))
    started = time.perf_counter()
    summary = run_file(source, target, settings, base_model=MODEL, actors=ACTORS)
    elapsed = time.perf_counter() - started
    assert summary["failed"] == 0, summary
    return elapsed


def count_answered(path: str) -> int:
    """Count result lines without an error."""
    with open(path) as handle:
        return sum(1 for line in handle if json.loads(line).get("error") is None)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 500 rows")
    args = parser.parse_args(argv)
    rounds, rows = (1, 500) if args.quick else (args.rounds, args.rows)
    info = _common.machine()
    print(f"# bench_ray: {_common.describe_machine(info)}", flush=True)
    scratch = tempfile.mkdtemp(prefix="lsray", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.makedirs(os.path.join(scratch, "home"))
    # Before Ray is imported: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import time.
    os.environ.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
            "HOME": os.path.join(scratch, "home"),
            "PYTHONPATH": os.pathsep.join(filter(None, [_common.REPO, os.environ.get("PYTHONPATH")])),
        }
    )
    env = dict(os.environ)
    source = os.path.join(scratch, "prompts.jsonl")
    write_prompts(source, rows)
    samples: Dict[str, List[float]] = {name: [] for name in CONTENDERS}
    init_seconds = float("nan")
    try:
        with _common.canned_engine(args.latency_ms) as engine:
            import ray

            started = time.perf_counter()
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=os.path.join(scratch, "t"),
                log_to_driver=False,
            )
            init_seconds = time.perf_counter() - started
            assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
            ray.data.DataContext.get_current().enable_progress_bars = False
            try:
                run_ray(engine.url, source, os.path.join(scratch, "warm.jsonl"))  # actors' first start, untimed
                for round_index in range(rounds):
                    order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
                    for name in order:
                        target = os.path.join(scratch, f"{name}.jsonl")
                        if name == "cli":
                            seconds = run_cli(engine.url, source, target, env)
                        else:
                            seconds = run_ray(engine.url, source, target)
                        assert count_answered(target) == rows
                        samples[name].append(rows / seconds)
                        print(f"round {round_index + 1} {name:<4} {rows / seconds:8.1f} rows/s", flush=True)
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cli, ray_rate = _common.median(samples["cli"]), _common.median(samples["ray"])
    ideal = CONCURRENCY / (args.latency_ms / 1000.0)
    headers = ["rows", "cli rows/s", "ray rows/s", "ray/cli", "ideal rows/s", "ray.init s"]
    table_rows = [[rows, cli, ray_rate, ray_rate / cli, ideal, init_seconds]]
    print()
    print(_common.table(headers, table_rows))
    print()
    print(_common.markdown_table(headers, table_rows))
    path = _common.write_results(
        "bench_ray",
        {
            "when": _common.stamp(),
            "machine": info,
            "latency_ms": args.latency_ms,
            "rounds": rounds,
            "rows": rows,
            "concurrency": CONCURRENCY,
            "actors": ACTORS,
            "samples": samples,
            "ray_init_seconds": init_seconds,
            "medians": dict(zip(headers, table_rows[0])),
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
