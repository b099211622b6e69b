"""Fan-out throughput and client CPU per request: lora_sampler versus raw urllib3, requests, httpx-async and openai.

An asyncio engine in its own process (``_canned_engine.py``) answers every completion with the same vLLM body after
a fixed service latency (0 ms and 20 ms). At each concurrency c, every contender sends the same JSON body and parses
the JSON answer; the contenders run alternately, several rounds, in this one process, and the medians are reported
with lora_sampler's ratio to each. Client CPU is this process's CPU time over the measured requests (the engine's
is not counted), divided by the requests.

    python benchmarks/bench_fanout.py [--quick] [--rounds 5] [--seconds 0.4] [--concurrency 1 8 32 128]
                                      [--latency-ms 0 20] [--contenders lora_sampler urllib3 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import _common

MODEL = "bench/base-model"
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975]
CONTENDERS = ("lora_sampler", "urllib3", "requests", "httpx-async", "openai")
#: Targets from issue 7.
MIN_RATIO_URLLIB3 = 0.8
MAX_CPU_RATIO_URLLIB3 = 1.25
MIN_IDEAL_FRACTION = 0.95
MIN_RATIO_HTTPX = 3.0
MIN_RATIO_OPENAI = 2.0
#: Measured seconds per contender and round (the batch is sized from the warm-up's rate), and the cap on requests.
DEFAULT_SECONDS = 0.4
MAX_REQUESTS = 2000
#: The client is "not the bottleneck" at 20 ms when, at the ideal rate, it would need less than this share of a core.
MAX_CLIENT_CORE_SHARE = 0.5
#: Per-request timeout of every contender, seconds (a hang must not stall the run).
TIMEOUT = 30.0


def payload() -> Dict[str, Any]:
    """Return the body lora_sampler sends for ``sample(PROMPT, base_model=MODEL)``; every contender sends it."""
    from lora_sampler import SampleRequest

    return SampleRequest(PROMPT, base_model=MODEL).to_payload(MODEL)


class Contender:
    """One client under test: ``setup`` (untimed), ``run(n)`` (timed), ``close`` (untimed)."""

    name = ""

    def __init__(self, url: str, concurrency: int):
        self.url, self.concurrency = url, concurrency
        self.body = payload()
        self.data = json.dumps(self.body, separators=(",", ":")).encode()
        self.headers = {"Content-Type": "application/json", "Authorization": "Bearer bench-key"}

    def run(self, n: int) -> int:
        """Send ``n`` completions with ``concurrency`` in flight; return how many came back as a parsed 200."""
        raise NotImplementedError

    def close(self) -> None:
        """Release threads and connections."""


class LoraSampler(Contender):
    """``SamplerClient(max_workers=c).sample_many``."""

    name = "lora_sampler"

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        from lora_sampler import SamplerClient, SampleRequest

        self.client = SamplerClient(url, api_key="bench-key", max_workers=concurrency, timeout=(TIMEOUT, TIMEOUT))
        self.request = SampleRequest(PROMPT, base_model=MODEL)
        self._one_each = _common.one_prompt_per_request(self.client.sample_many)  # as the other contenders send

    def run(self, n: int) -> int:
        results = self.client.sample_many([self.request] * n, **self._one_each)
        return sum(1 for r in results if r.sequences)

    def close(self) -> None:
        self.client.close()


class ThreadPoolContender(Contender):
    """A blocking client driven by a ``ThreadPoolExecutor`` of c threads (``one()`` sends one request)."""

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    def one(self, _: int) -> bool:
        raise NotImplementedError

    def run(self, n: int) -> int:
        return sum(self.pool.map(self.one, range(n)))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class RawUrllib3(ThreadPoolContender):
    """A raw ``urllib3.PoolManager`` (pool of c) with c threads."""

    name = "urllib3"

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        import urllib3

        self.manager = urllib3.PoolManager(
            maxsize=concurrency, retries=False, timeout=urllib3.Timeout(TIMEOUT, TIMEOUT)
        )
        self.target = url + "/v1/completions"

    def one(self, _: int) -> bool:
        response = self.manager.request("POST", self.target, body=self.data, headers=self.headers)
        return response.status == 200 and bool(json.loads(response.data)["choices"])

    def close(self) -> None:
        super().close()
        self.manager.clear()


class PlainRequests(ThreadPoolContender):
    """A plain ``requests.Session`` (its adapter's pool sized to c) with c threads."""

    name = "requests"

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        import requests

        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency))
        self.target = url + "/v1/completions"

    def one(self, _: int) -> bool:
        response = self.session.post(self.target, json=self.body, headers=self.headers, timeout=TIMEOUT)
        return response.status_code == 200 and bool(response.json()["choices"])

    def close(self) -> None:
        super().close()
        self.session.close()


class OpenAISync(ThreadPoolContender):
    """The ``openai`` SDK's sync client (``max_retries=0``) with c threads."""

    name = "openai"

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        from openai import OpenAI

        self.client = OpenAI(base_url=url + "/v1", api_key="bench-key", max_retries=0, timeout=TIMEOUT)
        self.extra = {k: v for k, v in self.body.items() if k in ("top_k", "return_token_ids")}

    def one(self, _: int) -> bool:
        completion = self.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=1,
            max_tokens=self.body["max_tokens"],
            temperature=self.body["temperature"],
            top_p=self.body["top_p"],
            logprobs=1,
            extra_body=self.extra,
        )
        return bool(completion.choices)

    def close(self) -> None:
        super().close()
        self.client.close()


class HttpxAsync(Contender):
    """An asynchronous implementation's shape: one ``httpx.AsyncClient``, ``asyncio.gather`` under a semaphore of c."""

    name = "httpx-async"

    def __init__(self, url: str, concurrency: int):
        super().__init__(url, concurrency)
        import httpx

        self.loop = asyncio.new_event_loop()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

        async def make() -> Any:
            return httpx.AsyncClient(base_url=url, limits=limits, timeout=TIMEOUT, headers=self.headers)

        self.client = self.loop.run_until_complete(make())

    def run(self, n: int) -> int:
        return self.loop.run_until_complete(self._run(n))

    async def _run(self, n: int) -> int:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def one() -> bool:
            async with semaphore:
                response = await self.client.post("/v1/completions", json=self.body)
                return response.status_code == 200 and bool(response.json()["choices"])

        return sum(await asyncio.gather(*(one() for _ in range(n))))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


FACTORIES: Dict[str, Callable[[str, int], Contender]] = {
    "lora_sampler": LoraSampler,
    "urllib3": RawUrllib3,
    "requests": PlainRequests,
    "httpx-async": HttpxAsync,
    "openai": OpenAISync,
}


def measure(name: str, url: str, concurrency: int, seconds: float, cap: int) -> Dict[str, float]:
    """Set one contender up, warm it, and time about ``seconds`` of requests (at most ``cap``).

    The warm-up (``max(2c, 20)`` requests) opens the connections and starts the threads; its rate sizes the
    measured batch, so a slow contender does not stretch the run and a fast one is not measured on a blip.
    """
    contender = FACTORIES[name](url, concurrency)
    try:
        warm = max(2 * concurrency, 20)
        wall0 = time.perf_counter()
        contender.run(warm)
        rate = warm / (time.perf_counter() - wall0)
        n = int(min(max(rate * seconds, warm), cap))
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        ok = contender.run(n)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        contender.close()
    return {"n": n, "ok": ok, "wall_s": wall, "cpu_s": cpu, "rps": n / wall, "cpu_us_per_req": 1e6 * cpu / n}


def run(
    concurrencies: Sequence[int], latencies: Sequence[float], rounds: int, seconds: float, contenders: Sequence[str]
) -> Dict[str, Any]:
    """Run every (latency, concurrency) cell: each round runs all contenders in turn (order rotated per round)."""
    cells: List[Dict[str, Any]] = []
    for latency in latencies:
        with _common.canned_engine(latency) as engine:
            for concurrency in concurrencies:
                samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in contenders}
                for round_number in range(rounds):
                    shift = round_number % len(contenders)
                    for name in list(contenders[shift:]) + list(contenders[:shift]):
                        samples[name].append(measure(name, engine.url, concurrency, seconds, MAX_REQUESTS))
                cell = {"latency_ms": latency, "concurrency": concurrency, "rounds": rounds}
                cell["median"] = {
                    name: {
                        "rps": _common.median([s["rps"] for s in runs]),
                        "cpu_us_per_req": _common.median([s["cpu_us_per_req"] for s in runs]),
                        "requests": sum(s["n"] for s in runs),
                        "failures": sum(s["n"] - s["ok"] for s in runs),
                    }
                    for name, runs in samples.items()
                }
                cell["samples"] = samples
                cells.append(cell)
                _print_cell(cell)
    return {"cells": cells, "targets": judge(cells)}


def _print_cell(cell: Dict[str, Any]) -> None:
    med = cell["median"]
    ours = med.get("lora_sampler")
    ideal = cell["concurrency"] / (cell["latency_ms"] / 1000.0) if cell["latency_ms"] > 0 else None
    rows = []
    for name, values in med.items():
        ratio = ours["rps"] / values["rps"] if ours else float("nan")
        cpu_ratio = ours["cpu_us_per_req"] / values["cpu_us_per_req"] if ours else float("nan")
        row = [name, values["rps"], values["cpu_us_per_req"], ratio, cpu_ratio, values["requests"], values["failures"]]
        rows.append(row + ([values["rps"] / ideal] if ideal else []))
    title = f"latency {cell['latency_ms']:g} ms, concurrency {cell['concurrency']}, {cell['rounds']} rounds"
    title += f", ideal {ideal:,.0f} req/s" if ideal else ""
    headers = ["contender", "req/s", "CPU us/req", "ours x req/s", "ours x CPU", "requests", "failures"]
    headers += ["x ideal"] if ideal else []
    print(f"\n{title}\n{_common.table(headers, rows)}", flush=True)


def judge(cells: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Apply the issue's targets to every cell that has the contenders they need."""
    verdicts: List[Dict[str, Any]] = []

    def add(target: str, cell: Dict[str, Any], value: float, limit: float, ok: Optional[bool], note: str = "") -> None:
        verdicts.append(
            {
                "target": target,
                "latency_ms": cell["latency_ms"],
                "concurrency": cell["concurrency"],
                "value": value,
                "limit": limit,
                "verdict": _common.verdict(ok),
                "note": note,
            }
        )

    for cell in cells:
        med = cell["median"]
        if "lora_sampler" not in med:
            continue
        ours = med["lora_sampler"]
        if cell["latency_ms"] <= 0:
            if "urllib3" in med:
                ratio = ours["rps"] / med["urllib3"]["rps"]
                add("req/s >= 0.8x urllib3", cell, ratio, MIN_RATIO_URLLIB3, ratio >= MIN_RATIO_URLLIB3)
                cpu = ours["cpu_us_per_req"] / med["urllib3"]["cpu_us_per_req"]
                add("CPU/req <= 1.25x urllib3", cell, cpu, MAX_CPU_RATIO_URLLIB3, cpu <= MAX_CPU_RATIO_URLLIB3)
            if "httpx-async" in med:
                ratio = ours["rps"] / med["httpx-async"]["rps"]
                add("req/s >= 3x httpx-async", cell, ratio, MIN_RATIO_HTTPX, ratio >= MIN_RATIO_HTTPX)
            if "openai" in med:
                ratio = ours["rps"] / med["openai"]["rps"]
                add("req/s >= 2x openai", cell, ratio, MIN_RATIO_OPENAI, ratio >= MIN_RATIO_OPENAI)
        else:
            ideal = cell["concurrency"] / (cell["latency_ms"] / 1000.0)
            fraction = ours["rps"] / ideal
            # Judged only where the client is not the bottleneck: at the ideal rate it would need under half a core.
            core_share = ideal * ours["cpu_us_per_req"] / 1e6
            judged = core_share < MAX_CLIENT_CORE_SHARE
            note = f"client needs {core_share:.2f} core at the ideal rate"
            if "urllib3" in med:
                note += f"; raw urllib3 reaches {med['urllib3']['rps'] / ideal:.2f} of ideal"
            ok = fraction >= MIN_IDEAL_FRACTION if judged else None
            add(">= 95% of ideal", cell, fraction, MIN_IDEAL_FRACTION, ok, note if judged else "not judged: " + note)
    return verdicts


def target_rows(verdicts: Sequence[Dict[str, Any]]) -> List[List[Any]]:
    """Return the verdicts as table rows."""
    return [
        [v["target"], f"{v['latency_ms']:g} ms", v["concurrency"], v["value"], v["limit"], v["verdict"], v["note"]]
        for v in verdicts
    ]


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments, run, print the tables and the targets, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.2 s, c in 8 32 (about 40 s)")
    parser.add_argument("--rounds", type=int, help="rounds per cell (default 5, quick 3)")
    parser.add_argument("--seconds", type=float, help=f"measured seconds per contender and round ({DEFAULT_SECONDS})")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrencies (default 1 8 32 128)")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0], help="engine latencies (0 20)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), help="subset to run")
    args = parser.parse_args(argv)
    for module in ("httpx", "openai"):
        try:
            __import__(module)
        except ImportError:
            print(f"{module} is missing: pip install -r benchmarks/requirements.txt", file=sys.stderr)
            return 2
    rounds = args.rounds or (3 if args.quick else 5)
    seconds = args.seconds or (DEFAULT_SECONDS / 2 if args.quick else DEFAULT_SECONDS)
    concurrencies = args.concurrency or ([8, 32] if args.quick else [1, 8, 32, 128])
    machine = _common.machine()
    print(f"bench_fanout on {_common.describe_machine(machine)}", flush=True)
    started = time.perf_counter()
    result = run(concurrencies, args.latency_ms, rounds, seconds, args.contenders)
    elapsed = time.perf_counter() - started
    print("\ntargets")
    print(
        _common.table(["target", "latency", "c", "value", "limit", "verdict", "note"], target_rows(result["targets"]))
    )
    command = "python benchmarks/bench_fanout.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"benchmark": "bench_fanout", "when": _common.stamp(), "command": command.strip(), "seconds": elapsed}
    payload.update(machine=machine, **result)
    print(f"\n{elapsed:.0f} s; wrote {_common.write_results('bench_fanout', payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
