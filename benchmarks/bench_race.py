"""The adapter-load race: N concurrent first requests for one adapter that becomes visible after D seconds.

A ``FakeEngine`` runs in its own process (``EngineProcess``) with a resolver directory; each round writes a
fresh adapter there and hides it for D seconds (``set_visibility_delay``), then fires N concurrent first requests.
Contenders, alternating within each round:

* ``lora_sampler``: ``SamplerClient(lora_base_dir=DIR, max_workers=N).sample_many`` (single-flight loads);
* ``naive per-request``: N threads on one ``requests.Session``; each failed request sends its own load, with no
  coordination, and waits the same jittered schedule (``RetryPolicy().delays()`` and ``retry.jitter``);
* ``no retry``: N threads, one request each.

Reported per contender (medians over rounds): time until all finished minus D (the overhead), load calls the
engine logged, completions sent, failures. Targets: all N succeed, about one load per backoff round, overhead at
most one backoff step (the nominal wait after the last attempt that can start before D).

    python benchmarks/bench_race.py [--quick] [--rounds 5] [--clients 64] [--delay 0.5]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import _common
import requests

from lora_sampler import RetryEvent, RetryPolicy, SamplerClient, SampleRequest
from lora_sampler.retry import jitter
from lora_sampler.testing import write_adapter
from lora_sampler.testing._serve import EngineProcess

PROMPT = [1, 450, 499, 173]  # ids below the fake engine's vocab_size (1024)
CONTENDERS = ("lora_sampler", "naive per-request", "no retry")
#: Per-request timeout, seconds.
TIMEOUT = 30.0


def backoff_step(policy: RetryPolicy, delay: float) -> float:
    """Return the nominal wait after the last attempt that can start before ``delay`` (fastest jitter: w/2)."""
    start, step = 0.0, 0.0
    waits = policy.delays()
    for _ in range(policy.max_attempts - 1):
        wait = next(waits)
        if start >= delay:
            break
        step = wait
        start += wait / 2
    return step


def run_lora_sampler(url: str, lora_dir: str, name: str, clients: int, arm: Callable[[], None]) -> Dict[str, Any]:
    """Fire ``clients`` first requests through one SamplerClient; return timing, outcomes and retry rounds.

    ``arm()`` hides the adapter (starts the visibility delay); it is called right before the requests go out.
    """
    rounds = [0]
    lock = threading.Lock()

    def on_retry(event: RetryEvent) -> None:
        with lock:
            rounds[0] = max(rounds[0], event.attempt)

    policy = RetryPolicy(on_retry=on_retry)
    with SamplerClient(url, lora_base_dir=lora_dir, max_workers=clients, retry=policy, timeout=TIMEOUT) as client:
        model = client.engine_model()  # a one-time GET /v1/models per client, not part of the race
        # Open the pooled connections first: the race is about first requests for an adapter, not first connects.
        client.sample_many([SampleRequest(PROMPT, base_model=model)] * (2 * clients))
        requests_ = [SampleRequest(PROMPT, adapter=name) for _ in range(clients)]
        arm()
        started = time.perf_counter()
        results = client.sample_many(
            requests_, return_exceptions=True, **_common.one_prompt_per_request(client.sample_many)
        )
        elapsed = time.perf_counter() - started
    failures = sum(1 for r in results if isinstance(r, BaseException))
    return {"elapsed_s": elapsed, "failures": failures, "failed_rounds": rounds[0]}


def run_naive(url: str, lora_dir: str, name: str, clients: int, arm: Callable[[], None], retry: bool) -> Dict[str, Any]:
    """Fire ``clients`` first requests on a plain ``requests.Session``; each retries and loads on its own."""
    policy = RetryPolicy()
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=clients + 4))
    body = {"model": name, "prompt": PROMPT, "max_tokens": 16, "logprobs": 1, "return_token_ids": True}
    load = {"lora_name": name, "lora_path": os.path.join(lora_dir, name)}
    rounds = [0]
    lock = threading.Lock()

    def one(_: int) -> bool:
        waits = policy.delays()
        for attempt in range(1, (policy.max_attempts if retry else 1) + 1):
            try:
                response = session.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
            except requests.RequestException:
                response = None
            if response is not None and response.status_code == 200:
                return True
            retriable = response is None or response.status_code == 404
            if response is not None and response.status_code == 400:
                text = response.text
                retriable = "does not exist" in text or "not found" in text or "could not be loaded" in text
            if not retry or not retriable or attempt == policy.max_attempts:
                return False
            with lock:
                rounds[0] = max(rounds[0], attempt)
            # The naive rule: every failed request sends its own load, with no coordination.
            with contextlib.suppress(requests.RequestException):
                session.post(url + "/v1/load_lora_adapter", json=load, timeout=policy.load_timeout)
            time.sleep(jitter(next(waits)))
        return False

    pool = concurrent.futures.ThreadPoolExecutor(clients)
    try:
        warm = {**body, "model": session.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]}
        list(pool.map(lambda _: _post_until_answered(session, url + "/v1/completions", warm), range(2 * clients)))
        arm()
        started = time.perf_counter()
        ok = sum(pool.map(one, range(clients)))
        elapsed = time.perf_counter() - started
    finally:
        pool.shutdown(wait=True)
        session.close()
    return {"elapsed_s": elapsed, "failures": clients - ok, "failed_rounds": rounds[0]}


def _post_until_answered(session: requests.Session, url: str, body: Dict[str, Any], tries: int = 5) -> None:
    """POST, retrying transport errors (the untimed warm-up opens many connections at once)."""
    for attempt in range(tries):
        try:
            session.post(url, json=body, timeout=TIMEOUT)
            return
        except requests.ConnectionError:
            if attempt == tries - 1:
                raise
            time.sleep(0.05)


def stats(engine: EngineProcess, name: str) -> Dict[str, Any]:
    """Count the completions and loads the engine logged for ``name``, by status."""
    by_path: Dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for record in engine.requests():
        if record["model"] == name:
            by_path[record["path"]][record["status"]] += 1
    completions, loads = by_path["/v1/completions"], by_path["/v1/load_lora_adapter"]
    return {
        "completions": sum(completions.values()),
        "completion_statuses": {str(k): v for k, v in sorted(completions.items())},
        "loads": sum(loads.values()),
        "load_statuses": {str(k): v for k, v in sorted(loads.items())},
        "max_loads_in_flight": engine.command("max_loads", name=name),
    }


def run(clients: int, delay: float, rounds: int) -> Dict[str, Any]:
    """Run the rounds (contender order rotated per round) and return samples, medians and verdicts."""
    lora_dir = tempfile.mkdtemp(prefix="bench-race-")
    samples: Dict[str, List[Dict[str, Any]]] = {name: [] for name in CONTENDERS}
    try:
        with EngineProcess(lora_dir, model="bench/base-model", max_loras=1024) as engine:
            for round_number in range(rounds):
                shift = round_number % len(CONTENDERS)
                for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
                    name = f"race-{round_number}-{contender.split()[0].replace('_', '-')}"
                    write_adapter(os.path.join(lora_dir, name), engine.model)
                    arm = partial(engine.command, "delay", name=name, seconds=delay)
                    if contender == "lora_sampler":
                        outcome = run_lora_sampler(engine.url, lora_dir, name, clients, arm)
                    else:
                        outcome = run_naive(engine.url, lora_dir, name, clients, arm, retry=contender != "no retry")
                    outcome.update(stats(engine, name))
                    outcome["overhead_s"] = outcome["elapsed_s"] - delay
                    samples[contender].append(outcome)
    finally:
        shutil.rmtree(lora_dir, ignore_errors=True)
    medians = {
        contender: {
            key: _common.median([float(s[key]) for s in runs])
            for key in ("elapsed_s", "overhead_s", "loads", "completions", "failures", "failed_rounds")
        }
        for contender, runs in samples.items()
    }
    return {"samples": samples, "median": medians}


def judge(result: Dict[str, Any], clients: int, step: float) -> List[Dict[str, Any]]:
    """Apply the targets to lora_sampler's rounds (every round must meet them, not only the median)."""
    runs = result["samples"]["lora_sampler"]
    worst_overhead = max(r["overhead_s"] for r in runs)
    extra_loads = max(r["loads"] - max(r["failed_rounds"], 1) for r in runs)
    failures = sum(r["failures"] for r in runs)
    return [
        {
            "target": f"all {clients} succeed (every round)",
            "value": failures,
            "limit": 0,
            "verdict": _common.verdict(failures == 0),
        },
        {
            "target": "loads <= failed backoff rounds + 1 (every round)",
            "value": f"max {max(r['loads'] for r in runs)} loads; worst round {extra_loads:+d} vs its rounds",
            "limit": "+1",
            "verdict": _common.verdict(extra_loads <= 1),
        },
        {
            "target": f"overhead <= one backoff step ({step:g} s), worst round",
            "value": round(worst_overhead, 3),
            "limit": step,
            "verdict": _common.verdict(worst_overhead <= step),
        },
    ]


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments, run, print the table and the targets, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, quick 2)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent first requests (default 64)")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds until the adapter is visible (0.5)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    machine = _common.machine()
    print(f"bench_race on {_common.describe_machine(machine)}", flush=True)
    step = backoff_step(RetryPolicy(), args.delay)
    started = time.perf_counter()
    result = run(args.clients, args.delay, rounds)
    elapsed = time.perf_counter() - started
    headers = ["contender", "overhead s", "until all done s", "load calls", "completions", "failed rounds", "failures"]
    rows = [
        [name, m["overhead_s"], m["elapsed_s"], m["loads"], m["completions"], m["failed_rounds"], m["failures"]]
        for name, m in result["median"].items()
    ]
    print(f"\n{args.clients} concurrent first requests, adapter visible after {args.delay:g} s, medians of {rounds}")
    print(_common.table(headers, rows))
    result["targets"] = judge(result, args.clients, step)
    print("\ntargets (lora_sampler)")
    print(_common.table(["target", "value", "limit", "verdict"], [list(v.values()) for v in result["targets"]]))
    command = "python benchmarks/bench_race.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"benchmark": "bench_race", "when": _common.stamp(), "command": command.strip(), "seconds": elapsed}
    payload.update(machine=machine, clients=args.clients, delay_s=args.delay, backoff_step_s=step, rounds=rounds)
    payload.update(result)
    print(f"\n{elapsed:.0f} s; wrote {_common.write_results('bench_race', payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
