"""Scoring isolation on loopback: a request asking for prompt logprobs never shares FakeEngine with another model's
request (so an engine that scores with the wrong adapter in mixed batches still gives right scores), sampling keeps
its overlap, ``mix_adapters`` turns it off, and ``sweep --score`` gives each checkpoint the scores it has alone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from _sweeps import ledger, make_run, sweep_args

from lora_sampler import SamplerClient, ScoreRequest, sweep
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter

PROMPTS = [[5 + i, 6, 7, 8, 9 + i] for i in range(12)]


def mixed_scoring(client: SamplerClient, adapters: List[str]) -> List[Any]:
    """Score every prompt under every adapter at once, the adapters interleaved."""
    requests = [ScoreRequest(prompt, adapter=name) for prompt in PROMPTS for name in adapters]
    return client.sample_many(requests)


def test_scoring_two_adapters_at_once_never_mixes_them(make_engine: Any, lora_dir: Path) -> None:
    """Interleaved scoring of two adapters: no scoring request shares the engine with the other adapter's."""
    engine = make_engine(latency=0.01)
    for name in ("alpha", "beta"):
        write_adapter(lora_dir / name, engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:
        mixed_scoring(client, ["alpha", "beta"])
        assert client.isolation.waits > 0
    assert engine.mixed_prompt_logprobs == 0


def test_scoring_with_mix_adapters_shares_the_engine(make_engine: Any, lora_dir: Path) -> None:
    """mix_adapters=True: the same workload puts scoring requests in flight beside the other adapter's."""
    engine = make_engine(latency=0.01)
    for name in ("alpha", "beta"):
        write_adapter(lora_dir / name, engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8, mix_adapters=True) as client:
        mixed_scoring(client, ["alpha", "beta"])
        assert client.isolation.waits == 0
    assert engine.mixed_prompt_logprobs > 0


def test_scoring_isolation_gives_right_scores_on_an_engine_that_mixes_adapters(
    make_engine: Any, lora_dir: Path
) -> None:
    """On FakeEngine(prompt_logprobs_defect="mixed-adapters"), interleaved scores equal each adapter's alone; with
    mix_adapters they do not (the defect is real, and isolation is what avoids it)."""
    engine = make_engine(latency=0.01, prompt_logprobs_defect="mixed-adapters")
    for name in ("alpha", "beta"):
        write_adapter(lora_dir / name, engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as alone:
        expected = [
            alone.sample_many([ScoreRequest(p, adapter=name)])[0].logprobs
            for p in PROMPTS
            for name in ("alpha", "beta")
        ]
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:
        assert [out.logprobs for out in mixed_scoring(client, ["alpha", "beta"])] == expected
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8, mix_adapters=True) as client:
        for _ in range(20):  # until a run where the engine saw the adapters mixed (batched, they may not overlap)
            mixed_before = engine.mixed_prompt_logprobs
            scores = [out.logprobs for out in mixed_scoring(client, ["alpha", "beta"])]
            if engine.mixed_prompt_logprobs > mixed_before:
                break
        assert engine.mixed_prompt_logprobs > mixed_before  # the overlap happened
        assert scores != expected


def test_sampling_without_prompt_logprobs_keeps_its_overlap(make_engine: Any, lora_dir: Path) -> None:
    """Sampling two adapters and the base at once: nothing waits, requests of several models are in flight together."""
    engine = make_engine(latency=0.02)
    for name in ("alpha", "beta"):
        write_adapter(lora_dir / name, engine.model)
    requests = [
        {"prompt": prompt, "adapter": name, "max_tokens": 2} for prompt in PROMPTS for name in ("alpha", "beta")
    ] + [{"prompt": prompt, "base_model": engine.model, "max_tokens": 2} for prompt in PROMPTS]
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:
        assert len(client.sample_many(requests)) == len(requests)
        assert client.isolation.waits == 0


def write_lines(path: Path) -> Path:
    lines = [{"id": f"q{i}", "prompt": prompt} for i, prompt in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def alone_means(engine: FakeEngine, lora_dir: Path, tmp_path: Path, archives: List[str]) -> Dict[str, float]:
    """Each checkpoint scored alone with ``lora-sampler score --concurrency 1``: its mean sum per line."""
    means = {}
    for archive in archives:
        out = tmp_path / f"alone-{Path(archive).name}.jsonl"
        argv = ["score", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter", archive]
        argv += ["--input", str(tmp_path / "lines.jsonl"), "--output", str(out), "--concurrency", "1", "--quiet"]
        assert main(argv) == 0
        sums = [json.loads(line)["sum"] for line in out.read_text().splitlines()]
        means[archive] = sum(sums) / len(sums)
    return means


def test_sweep_score_gives_each_checkpoint_its_score_alone_on_an_engine_that_mixes_adapters(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """sweep --score over three checkpoints (window 2, the warm-up of the next one included) on an engine that
    scores with another in-flight adapter: each mean sum equals the checkpoint's scored alone, and no scoring request
    shared the engine with another model's."""
    engine = make_engine(latency=0.005, prompt_logprobs_defect="mixed-adapters")
    archives = make_run(tmp_path / "run", engine.model, (100, 200, 300))
    write_lines(tmp_path / "lines.jsonl")
    expected = alone_means(engine, lora_dir, tmp_path, archives)
    engine.reset_log()
    for concurrency in ("8", "1"):
        out = tmp_path / f"out-{concurrency}"
        argv = sweep_args(engine, lora_dir, tmp_path / "lines.jsonl", out, "--score", "--quiet")
        argv += ["--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--concurrency", concurrency]
        assert main(argv) == 0
        got = {entry["checkpoint"]: entry["mean_sum"] for entry in ledger(out)}
        assert got.keys() == set(expected)
        for archive, mean in expected.items():
            assert abs(got[archive] - mean) < 1e-9, (concurrency, archive)
    assert engine.mixed_prompt_logprobs == 0


def test_sweep_score_warms_each_checkpoint_by_a_load_call(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Scoring sweep with isolation: each checkpoint is warmed by one load call, not by a one-token completion (which
    would wait for the previous checkpoint's scoring rows); with --mix-adapters the one-token warm-up stays."""
    engine = make_engine()
    make_run(tmp_path / "run", engine.model, (100, 200, 300))
    write_lines(tmp_path / "lines.jsonl")
    for mix, warm_ups in (False, 0), (True, 3):
        engine.reset_log()
        out = tmp_path / f"out-{mix}"
        argv = sweep_args(engine, lora_dir, tmp_path / "lines.jsonl", out, "--score", "--quiet")
        argv += ["--checkpoints", str(tmp_path / "run" / "*.tar.gz"), *(["--mix-adapters"] if mix else [])]
        assert main(argv) == 0
        completions = [r for r in engine.requests if r.path == "/v1/completions"]
        assert sum(r.prompts for r in completions) == 3 * len(PROMPTS) + warm_ups  # rows go many to a request
        if not mix:
            loads = [r.model for r in engine.requests if r.path == "/v1/load_lora_adapter"]
            assert sorted(loads) == sorted(entry["adapter"] for entry in ledger(out))


def test_isolated_scoring_beside_another_calls_mixing_gets_its_own_scores(make_engine: Any, lora_dir: Path) -> None:
    """While one call mixes (``mixing()``, as ``check_scoring(concurrent=True)`` does), another thread's default
    scoring is still kept apart from it: right scores on an engine that mixes adapters (169 of 800 were wrong), and
    the mixing call keeps running throughout (its requests wait their turn, they are not refused)."""
    engine = make_engine(latency=0.02, prompt_logprobs_defect="mixed-adapters")
    for name in ("alpha", "beta"):
        write_adapter(lora_dir / name, engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as alone:
        expected = [out.logprobs for out in alone.sample_many([ScoreRequest(p, adapter="alpha") for p in PROMPTS])]
    stop, looping = threading.Event(), threading.Event()
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:

        def mixing_call() -> None:
            with client.isolation.mixing():
                while not stop.is_set():
                    client.sample_many([ScoreRequest(p, adapter="beta") for p in PROMPTS[:4]], prompts_per_request=1)
                    looping.set()

        caller = threading.Thread(target=mixing_call)
        caller.start()
        try:
            assert looping.wait(60)  # the mixing call is mid-run before the scoring starts
            beta_before = engine.calls("/v1/completions", "beta")
            scores = [
                out.logprobs
                for out in client.sample_many(
                    [ScoreRequest(p, adapter="alpha") for p in PROMPTS], prompts_per_request=1
                )
            ]
            beta_during = engine.calls("/v1/completions", "beta") - beta_before
        finally:
            stop.set()
            caller.join(60)
        assert not caller.is_alive()
        assert client.isolation.waits > 0  # requests met: the overlap was there to be had, and was refused
    assert beta_during > 0  # the mixing call ran on while the scoring ran
    assert scores == expected


def test_isolated_scoring_beside_a_mixing_sweep_gets_its_own_scores(
    make_engine: Any, lora_dir: Path, tmp_path: Path
) -> None:
    """A sweep(..., mix_adapters=True, score=True) mid-run on the same client: another thread's default scoring still
    gets each prompt's score alone on an engine that mixes adapters (19 of 800 were wrong), and the sweep finishes."""
    engine = make_engine(latency=0.02, prompt_logprobs_defect="mixed-adapters")
    write_adapter(lora_dir / "alpha", engine.model)
    make_run(tmp_path / "run", engine.model, (100, 200, 300))
    lines = [{"id": f"q{i}", "prompt": [5 + i % 30, 6, 7, 8]} for i in range(60)]
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as alone:
        expected = [out.logprobs for out in alone.sample_many([ScoreRequest(p, adapter="alpha") for p in PROMPTS])]
    outcome: List[Any] = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:

        def run_sweep() -> None:
            try:
                reports = sweep(
                    client,
                    str(tmp_path / "run" / "*.tar.gz"),
                    lines,
                    output_dir=str(tmp_path / "out"),
                    score=True,
                    mix_adapters=True,
                    prompts_per_request=1,
                )
                outcome.extend(reports)
            except BaseException as error:  # the assertion below names it
                outcome.append(error)

        sweeper = threading.Thread(target=run_sweep)
        sweeper.start()
        try:
            started = time.monotonic()
            while sum(r.path == "/v1/completions" and r.model != "alpha" for r in engine.requests) < 5:
                assert sweeper.is_alive() and time.monotonic() - started < 60  # the sweep is mid-run first
                threading.Event().wait(0.01)
            scores = [
                out.logprobs
                for out in client.sample_many(
                    [ScoreRequest(p, adapter="alpha") for p in PROMPTS], prompts_per_request=1
                )
            ]
            sweep_requests_during = sweeper.is_alive()
        finally:
            sweeper.join(120)
    assert not sweeper.is_alive() and len(outcome) == 3 and all(not r.error for r in outcome), outcome
    assert sweep_requests_during  # the overlap was there to be had
    assert scores == expected


def test_a_mix_adapters_sweep_mixes_its_own_scoring_requests(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """``sweep(mix_adapters=True)`` on a client that keeps scoring apart: the sweep's own scoring requests share the
    engine (its checkpoints' threads and its batch jobs' pumps run in the context of its ``mixing()``); without it
    they never do. Before, the pump ran outside that context, so a mixing sweep was kept apart all the same (20 runs
    of 20 never mixed)."""
    engine = make_engine(latency=0.01)
    make_run(tmp_path / "run", engine.model, (100, 200, 300))
    write_lines(tmp_path / "lines.jsonl")
    pattern, lines = str(tmp_path / "run" / "*.tar.gz"), str(tmp_path / "lines.jsonl")
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=8) as client:
        list(sweep(client, pattern, lines, output_dir=tmp_path / "apart", score=True, prompts_per_request=1))
        assert engine.mixed_prompt_logprobs == 0
        for attempt in range(20):  # until a run whose checkpoints met in flight (a boundary may fall between rows)
            out = tmp_path / f"mixed-{attempt}"
            list(sweep(client, pattern, lines, output_dir=out, score=True, prompts_per_request=1, mix_adapters=True))
            if engine.mixed_prompt_logprobs > 0:
                break
    assert engine.mixed_prompt_logprobs > 0
