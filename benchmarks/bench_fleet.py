"""The time until a fleet serves a new adapter, and failed first requests, against the number of replicas.

1, 4, 16 and 64 FakeEngine replicas WITHOUT a resolver (they serve an adapter only once it was loaded on them), 0.5 s
per load, behind a real vllm-router (``--policy consistent_hash``). For each fleet size, two contenders, run
alternately, several rounds, each with a fresh adapter:

- ``single-flight``: ``SamplerClient(router)`` (``replicas=None``, as before fleet mode): ``publish`` writes the
  folder, then the load race's proactive load (one per round, through the router) reaches one replica at a time;
- ``fleet``: ``SamplerClient(router, replicas="router")``: ``publish`` loads on every replica in parallel and
  returns once each lists the adapter; the race reconciles the fleet.

Then 64 first requests for the adapter (``sample_many``, 64 threads). Reported per contender (medians): ``publish``
(the call's wall time), ``every replica`` (from the start of ``publish`` until the last replica's first successful
load answered; ``-`` when some replica never loaded it), replicas serving, failed first requests of 64, loads sent.
Goal: fleet ``every replica`` <= 1.5 x one load time at 64 replicas, 0 failures. Needs the ``vllm-router``
executable (``pip install vllm-router==0.1.17``).

    python benchmarks/bench_fleet.py [--quick] [--rounds 3] [--replicas 1 4 16 64] [--load-latency 0.5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import _common
from bench_router import router_process, wait_healthy

MODEL = "bench/base-model"
CONTENDERS = ("single-flight", "fleet")
FIRST_REQUESTS = 64
#: The goal, in load times, for the fleet contender at the largest fleet.
GOAL_LOAD_TIMES = 1.5


def fleet_process(replicas: int, load_latency: float) -> _common.ServerProcess:
    """Return (not started) the process hosting ``replicas`` resolver-less FakeEngines."""
    script = os.path.join(_common.HERE, "_run_fake_fleet.py")
    argv = [sys.executable, script, "--replicas", str(replicas), "--model", MODEL]
    return _common.ServerProcess([*argv, "--load-latency", str(load_latency)])


def run_once(contender: str, router_url: str, fleet: _common.ServerProcess, folder: str, tag: str) -> Dict[str, Any]:
    """Publish a fresh adapter with one contender, send 64 first requests, and return what was measured."""
    from lora_sampler import SampleOutput, SamplerClient
    from lora_sampler.testing import write_adapter

    checkpoint = write_adapter(os.path.join(folder, "checkpoints", tag), MODEL)
    replicas = "router" if contender == "fleet" else None
    with SamplerClient(router_url, lora_base_dir=os.path.join(folder, "loras"), max_workers=FIRST_REQUESTS,
                       replicas=replicas, timeout=(30.0, 60.0)) as client:  # fmt: skip
        client.engine_model()  # the preflight's GET /v1/models, outside the measured part
        started = time.monotonic()
        adapter = client.publish(checkpoint)
        published = time.monotonic() - started
        rows = [{"prompt": [1, 2, i], "adapter": adapter} for i in range(FIRST_REQUESTS)]
        results = client.sample_many(rows, return_exceptions=True, **_common.one_prompt_per_request(client.sample_many))
    per_replica = fleet.command(op="loads", name=adapter.name)["replicas"]
    served = [r["served_at"] for r in per_replica]
    return {
        "publish_s": published,
        "every_replica_s": max(served) - started if all(s is not None for s in served) else None,
        "serving": sum(s is not None for s in served),
        "replicas": len(served),
        "failed": sum(not isinstance(r, SampleOutput) for r in results),
        "loads": sum(r["loads"] for r in per_replica),
    }


def _median_or_none(values: List[Optional[float]]) -> Optional[float]:
    """The median, or None when any run never got there (a fleet that never served the adapter everywhere)."""
    return None if any(v is None for v in values) else _common.median([float(v) for v in values if v is not None])


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--load-latency", type=float, default=0.5, help="seconds per adapter load (default 0.5)")
    parser.add_argument("--quick", action="store_true", help="1 round, 1, 4 and 16 replicas")
    args = parser.parse_args(argv)
    rounds, sizes = (1, [1, 4, 16]) if args.quick else (args.rounds, args.replicas)
    info = _common.machine()
    print(f"# bench_fleet: {_common.describe_machine(info)}", flush=True)
    samples: Dict[str, Dict[int, List[Dict[str, Any]]]] = {c: {n: [] for n in sizes} for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="bench_fleet-") as folder:
        os.makedirs(os.path.join(folder, "loras"))
        for n in sizes:
            with contextlib.ExitStack() as stack:
                fleet = stack.enter_context(fleet_process(n, args.load_latency))
                router = stack.enter_context(router_process(list(fleet.info["urls"])))
                wait_healthy(router.url, timeout=60.0)
                for round_index in range(rounds):
                    order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
                    for contender in order:
                        run = run_once(contender, router.url, fleet, folder, f"r{n}-{round_index}-{contender}")
                        samples[contender][n].append(run)
                        every = run["every_replica_s"]
                        print(
                            f"replicas={n:<3} round {round_index + 1} {contender:<13} publish {run['publish_s']:.2f} s"
                            f"  every replica {'-' if every is None else f'{every:.2f} s'}  serving "
                            f"{run['serving']}/{n}  failed {run['failed']}/{FIRST_REQUESTS}  loads {run['loads']}",
                            flush=True,
                        )
    headers = ["replicas", "mode", "publish s", "every replica s", "in load times", "serving", "failed/64", "loads"]
    rows = []
    for n in sizes:
        for contender in CONTENDERS:
            runs = samples[contender][n]
            every = _median_or_none([r["every_replica_s"] for r in runs])
            rows.append(
                [
                    n,
                    contender,
                    _common.median([r["publish_s"] for r in runs]),
                    "-" if every is None else every,
                    "-" if every is None else every / args.load_latency,
                    f"{min(r['serving'] for r in runs)}/{n}",
                    max(r["failed"] for r in runs),
                    int(_common.median([r["loads"] for r in runs])),
                ]
            )
    largest = next(r for r in rows if r[0] == max(sizes) and r[1] == "fleet")
    goal_met = isinstance(largest[4], float) and largest[4] <= GOAL_LOAD_TIMES and largest[6] == 0
    print()
    print(_common.table(headers, rows))
    print()
    print(_common.markdown_table(headers, rows))
    print(
        f"\ngoal: fleet at {max(sizes)} replicas serves everywhere within {GOAL_LOAD_TIMES} load times, 0 failed: "
        f"{_common.verdict(goal_met)}"
    )
    path = _common.write_results(
        "bench_fleet",
        {
            "when": _common.stamp(),
            "machine": info,
            "command": "python benchmarks/bench_fleet.py " + " ".join(sys.argv[1:]),
            "load_latency_s": args.load_latency,
            "first_requests": FIRST_REQUESTS,
            "rounds": rounds,
            "samples": samples,
            "medians": [dict(zip(headers, row)) for row in rows],
            "goal_met": goal_met,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
