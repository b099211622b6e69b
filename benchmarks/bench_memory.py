"""Memory of ``imap`` over a generator of a million prompts: the resident set must stay flat.

A canned engine (``_canned_engine.py``, 0 ms) runs in its own process. ``SamplerClient.imap`` consumes a generator
of ``--count`` fresh ``SampleRequest`` values; a sampler thread reads this process's ``VmRSS`` from
``/proc/self/status`` every 20 ms. The baseline is taken after the client is warm (threads started, connections
open); the peak growth over that baseline is reported at 10%, 50% and 100% of the prompts. Target: under 100 MB,
and flat (the growth from 10% to 100% is at most ``FLAT_MB``).

    python benchmarks/bench_memory.py [--quick] [--count 1000000] [--workers 16]
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

import _common

from lora_sampler import SamplerClient, SampleRequest

MODEL = "bench/base-model"
#: Targets: peak growth over the warm baseline, and the allowed growth between 10% and 100% of the run.
MAX_GROWTH_MB = 100.0
FLAT_MB = 10.0
#: Seconds between two RSS samples.
SAMPLE_INTERVAL = 0.02
MILESTONES = (0.1, 0.5, 1.0)


class RssSampler(threading.Thread):
    """Reads this process's VmRSS every ``SAMPLE_INTERVAL`` seconds and keeps the peak."""

    def __init__(self) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.peak = self.current = _common.rss_bytes()
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self._halt.wait(SAMPLE_INTERVAL):
            self.current = _common.rss_bytes()
            self.peak = max(self.peak, self.current)
            self.samples += 1

    def stop(self) -> None:
        """Stop sampling and take one last sample."""
        self._halt.set()
        self.join()
        self.current = _common.rss_bytes()
        self.peak = max(self.peak, self.current)


def prompts(count: int) -> Iterator[SampleRequest]:
    """Yield ``count`` distinct requests, built lazily (a list of a million would be the leak we look for)."""
    for index in range(count):
        yield SampleRequest([1, 4 + index % 256, 4 + (index // 256) % 256, 7], base_model=MODEL)


def run(url: str, count: int, workers: int) -> Dict[str, Any]:
    """Consume ``count`` prompts through ``imap`` and return the RSS growth at each milestone."""
    mb = 1 / (1 << 20)
    with SamplerClient(url, max_workers=workers) as client:
        for _ in client.imap(prompts(4 * workers)):  # warm: threads started, connections open
            pass
        gc.collect()
        sampler = RssSampler()
        baseline = sampler.current
        sampler.start()
        marks = {int(count * share): share for share in MILESTONES}
        points: List[Dict[str, Any]] = []
        started = time.perf_counter()
        for done, output in enumerate(client.imap(prompts(count)), 1):
            if not output.sequences:
                raise RuntimeError("an empty completion came back")
            if done in marks:
                now = _common.rss_bytes()
                sampler.peak = max(sampler.peak, now)
                point = {
                    "share": marks[done],
                    "done": done,
                    "seconds": time.perf_counter() - started,
                    "rss_mb": now * mb,
                    "growth_mb": (now - baseline) * mb,
                    "peak_growth_mb": (sampler.peak - baseline) * mb,
                }
                points.append(point)
                print(
                    f"{marks[done]:>5.0%}  {done:>9,} prompts  {point['seconds']:7.1f} s  RSS {point['rss_mb']:7.1f} MB"
                    f"  growth {point['growth_mb']:6.1f} MB  peak growth {point['peak_growth_mb']:6.1f} MB",
                    flush=True,
                )
        elapsed = time.perf_counter() - started
        sampler.stop()
    return {
        "count": count,
        "workers": workers,
        "baseline_rss_mb": baseline * mb,
        "seconds": elapsed,
        "rps": count / elapsed,
        "rss_samples": sampler.samples,
        "points": points,
    }


def judge(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Apply the targets: peak growth under ``MAX_GROWTH_MB`` and flat from 10% to 100%."""
    points = result["points"]
    peak = points[-1]["peak_growth_mb"]
    drift = points[-1]["peak_growth_mb"] - points[0]["peak_growth_mb"]
    return [
        {
            "target": f"peak RSS growth < {MAX_GROWTH_MB:g} MB",
            "value": round(peak, 1),
            "limit": MAX_GROWTH_MB,
            "verdict": _common.verdict(peak < MAX_GROWTH_MB),
        },
        {
            "target": f"flat: peak growth 10% -> 100% <= {FLAT_MB:g} MB",
            "value": round(drift, 1),
            "limit": FLAT_MB,
            "verdict": _common.verdict(drift <= FLAT_MB),
        },
    ]


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments, run, print the milestones and the targets, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 prompts instead of 1,000,000")
    parser.add_argument("--count", type=int, help="prompts (default 1,000,000; quick 100,000)")
    parser.add_argument("--workers", type=int, default=16, help="SamplerClient max_workers (default 16)")
    args = parser.parse_args(argv)
    count = args.count or (100_000 if args.quick else 1_000_000)
    machine = _common.machine()
    print(f"bench_memory on {_common.describe_machine(machine)}: {count:,} prompts, max_workers={args.workers}")
    with _common.canned_engine(0) as engine:
        result = run(engine.url, count, args.workers)
    result["targets"] = judge(result)
    print(f"\n{result['seconds']:.0f} s, {result['rps']:,.0f} req/s, baseline RSS {result['baseline_rss_mb']:.1f} MB")
    print(_common.table(["target", "value", "limit", "verdict"], [list(v.values()) for v in result["targets"]]))
    command = "python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"benchmark": "bench_memory", "when": _common.stamp(), "command": command.strip()}
    payload.update(machine=machine, **result)
    print(f"wrote {_common.write_results('bench_memory', payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
