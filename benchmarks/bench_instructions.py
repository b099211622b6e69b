"""Client CPU per request, counted in instructions: the figure that does not depend on the machine's load.

A worker process runs ``SamplerClient(max_workers=1).sample_many`` over N base-model requests against the canned
engine (``_canned_engine.py``, its own process, not counted) under ``valgrind --tool=callgrind``; a second worker
does everything the same but sends no measured request. Both send the same warm-up requests first, so connection
setup and first-use imports fall out of the difference, and the instructions per request are
``(run of N - run of none) / N``. The JSON decoder is the standard library's in both runs (the optional ``[fast]``
extra is hidden), so trees without it compare alike.

    python benchmarks/bench_instructions.py [--tree DIR] [--label NAME] [--requests 1000] [--warmup 20]

``--tree`` is the checkout whose ``lora_sampler`` is measured (default: this one), so an older commit in a git
worktree can be counted with the same interpreter and engine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

MODEL = "bench/base-model"
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975]
#: Requests measured, and the warm-up requests both runs send before them.
DEFAULT_REQUESTS = 1000
DEFAULT_WARMUP = 20
#: Largest tolerated growth of instructions per request against a baseline (issue 18: within 3 %).
MAX_GROWTH = 0.03
_SUMMARY = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def worker(url: str, requests: int, warmup: int, prompts_per_request: int) -> None:
    """Send ``warmup`` then ``requests`` completions through one client (the process valgrind counts).

    ``prompts_per_request`` (1 by default: one request per prompt, as every tree before it sent) is passed when the
    measured tree's ``sample_many`` takes it.
    """
    sys.modules["msgspec"] = None  # type: ignore[assignment]  # the stdlib decoder, as on trees without [fast]
    import lora_sampler
    from lora_sampler import SamplerClient, SampleRequest

    request = SampleRequest(PROMPT, base_model=MODEL)
    with SamplerClient(url, api_key="bench-key", max_workers=1) as client:
        takes = "prompts_per_request" in inspect.signature(client.sample_many).parameters
        batching = {"prompts_per_request": prompts_per_request} if takes else {}
        assert len(client.sample_many([request] * warmup, **batching)) == warmup
        outputs = client.sample_many([request] * requests, **batching) if requests else []
        assert len(outputs) == requests and all(output.sequences for output in outputs)
    print(json.dumps({"lora_sampler": os.path.dirname(lora_sampler.__file__)}), flush=True)


def count(tree: str, url: str, requests: int, warmup: int, prompts_per_request: int = 1) -> Dict[str, Any]:
    """Run one worker under callgrind; return its total instructions and which package it measured."""
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as scratch:
        out = os.path.join(scratch, "callgrind.out")
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
        argv += ["--worker", url, "--requests", str(requests), "--warmup", str(warmup)]
        argv += ["--prompts-per-request", str(prompts_per_request)]
        env = dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the callgrind worker failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(out) as handle:
            match = _SUMMARY.search(handle.read())
    if match is None:
        raise RuntimeError("callgrind wrote no summary line")
    package = json.loads(done.stdout.strip().splitlines()[-1])["lora_sampler"]
    if os.path.dirname(package) != tree:
        raise RuntimeError(f"the worker measured {package}, not the lora_sampler of {tree}")
    return {"instructions": int(match.group(1)), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--label", default="after", help="results file suffix: bench_instructions_<label>.json")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--baseline", help="a results file to compare with (e.g. the 'before' run)")
    parser.add_argument(
        "--prompts-per-request",
        type=int,
        default=1,
        help="prompts per request (default 1, as trees before batching sent them; the figure is then per prompt)",
    )
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.requests, args.warmup, args.prompts_per_request)
        return
    import _common  # not in the worker: it puts this checkout's lora_sampler first on the path

    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions needs valgrind (apt-get install valgrind)")
    tree = os.path.abspath(args.tree)
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with _common.canned_engine(0) as engine:
        none = count(tree, engine.url, 0, args.warmup, args.prompts_per_request)
        full = count(tree, engine.url, args.requests, args.warmup, args.prompts_per_request)
    per_request = (full["instructions"] - none["instructions"]) / args.requests
    results: Dict[str, Any] = {
        "benchmark": "bench_instructions",
        "when": _common.stamp(),
        "machine": _common.machine(),
        "commit": commit,
        "requests": args.requests,
        "warmup": args.warmup,
        "decoder": "json (stdlib)",
        "run_of_none": none,
        "run_of_requests": full,
        "instructions_per_request": round(per_request),
    }
    print(f"{args.label}: {per_request / 1e6:.3f} M instructions per request ({commit[:7]}, {args.requests} requests)")
    if args.baseline:
        with open(args.baseline) as handle:
            before = json.load(handle)["instructions_per_request"]
        growth = per_request / before - 1
        results["baseline"] = {"file": os.path.basename(args.baseline), "instructions_per_request": before}
        results["growth"] = round(growth, 4)
        results["within_target"] = growth <= MAX_GROWTH
        print(f"against {before / 1e6:.3f} M: {growth:+.1%} ({_common.verdict(growth <= MAX_GROWTH)})")
    print(_common.write_results(f"bench_instructions_{args.label}", results))


if __name__ == "__main__":
    main()
