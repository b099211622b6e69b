"""lm-eval's tasks on every checkpoint of a sweep: ``lm_eval_tasks`` (``--lm-eval-tasks``), on FakeEngine.

Per checkpoint lm-eval's results JSON under OUT/lm-eval/, its numbers as ``<task>/<key>`` in the reports and
sweep.jsonl; each distinct text tokenized once per sweep; a checkpoint killed mid-task is evaluated again on resume,
one finished is not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _lm_eval_tasks import write_byte_tokenizer

import lora_sampler
from lora_sampler import OutageEvent, RetryPolicy, SamplerClient, SweepSettings
from lora_sampler._wire.routes import COMPLETIONS_PATH, TOKENIZE_PATH
from lora_sampler.batch import EvaluatedCheckpoint
from lora_sampler.cli import main
from lora_sampler.lm_eval import LmEvalTasks
from lora_sampler.publish import default_adapter_name
from lora_sampler.testing import FakeEngine, write_adapter_archive

#: lm-eval's arguments of the tests' sweeps: no bootstrap (seconds of numpy), the test engine's prefix token.
ARGUMENTS = {"bootstrap_iters": 0, "model_args": {"prefix_token_id": 1}}


def checkpoints(folder: Path, model: str, count: int) -> List[str]:
    """``count`` checkpoints with different contents (each its own rank)."""
    folder.mkdir(exist_ok=True)
    return [write_adapter_archive(folder / f"step-{step}.tar.gz", model, rank=2**step) for step in range(1, count + 1)]


@pytest.mark.timeout(1200)  # four lm-eval runs; minutes on a loaded 2-core machine
def test_sweep_runs_the_tasks_on_every_checkpoint(
    engine: FakeEngine, tasks: Path, lora_dir: Path, tmp_path: Path
) -> None:
    """Three checkpoints: lm-eval's numbers per checkpoint, its results JSON each; texts tokenized once per sweep."""
    paths = checkpoints(tmp_path / "run", engine.model, 3)
    output = tmp_path / "out"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(
            lora_sampler.sweep(
                client,
                paths,
                output_dir=str(output),
                lm_eval_tasks="tiny_mc,tiny_ppl",
                lm_eval_include_path=str(tasks),
                lm_eval_args={"bootstrap_iters": 0, "model_args": {"prefix_token_id": 1}},
                settle=0,
            )
        )
    assert [report.error for report in reports] == [None, None, None]
    for report in reports:
        assert {"tiny_mc/acc,none", "tiny_mc/acc_norm,none", "tiny_ppl/word_perplexity,none"} <= set(report.metrics)
        saved = json.loads((output / "lm-eval" / f"{report.adapter}.json").read_text(encoding="utf-8"))
        assert saved["results"]["tiny_mc"]["acc,none"] == report.metrics["tiny_mc/acc,none"]
    assert len({report.metrics["tiny_ppl/word_perplexity,none"] for report in reports}) == 3  # each its adapter
    ledger = [json.loads(line) for line in (output / "sweep.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [entry["metrics"]["tiny_mc/acc,none"] for entry in ledger] == [
        r.metrics["tiny_mc/acc,none"] for r in reports
    ]
    tokenized = engine.calls(TOKENIZE_PATH)
    engine.reset_log()
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        list(
            lora_sampler.sweep(
                client,
                paths[:1],
                output_dir=str(tmp_path / "one"),
                lm_eval_tasks=["tiny_mc", "tiny_ppl"],
                lm_eval_include_path=str(tasks),
                lm_eval_args={"model_args": "prefix_token_id=1"},
                settle=0,
            )
        )
    assert engine.calls(TOKENIZE_PATH) == tokenized  # three checkpoints asked for what one asks for


@pytest.mark.timeout(1200)  # two lm-eval runs; minutes on a loaded 2-core machine
def test_sweep_with_the_models_own_tokenizer_asks_the_engine_one_text(
    engine: FakeEngine, tasks: Path, lora_dir: Path, tmp_path: Path
) -> None:
    """model_args' tokenizer serves every checkpoint: one /tokenize request in the sweep (the agreement check), the
    same numbers as the engine's tokenizer gives; a path with no tokenizer fails the sweep before any request."""
    paths = checkpoints(tmp_path / "run", engine.model, 2)
    folder = write_byte_tokenizer(tmp_path / "model")
    settings: Dict[str, Any] = dict(lm_eval_tasks="tiny_mc", lm_eval_include_path=str(tasks), settle=0)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        remote = list(
            lora_sampler.sweep(client, paths, output_dir=str(tmp_path / "a"), lm_eval_args=ARGUMENTS, **settings)
        )
        engine.reset_log()
        own = {"bootstrap_iters": 0, "model_args": {"prefix_token_id": 1, "tokenizer": str(folder)}}
        local = list(lora_sampler.sweep(client, paths, output_dir=str(tmp_path / "b"), lm_eval_args=own, **settings))
        assert engine.calls(TOKENIZE_PATH) == 1
        engine.reset_log()
        missing = {"model_args": {"tokenizer": str(tmp_path / "nowhere")}}
        with pytest.raises(ValueError, match=r"no tokenizer\.json there"):
            lora_sampler.sweep(client, paths, output_dir=str(tmp_path / "c"), lm_eval_args=missing, **settings)
        assert engine.calls(COMPLETIONS_PATH) == 0
    assert [r.error for r in local] == [None, None] and [r.metrics for r in local] == [r.metrics for r in remote]


def test_lm_eval_settings_are_checked_before_any_request(engine: FakeEngine, tasks: Path, tmp_path: Path) -> None:
    with SamplerClient(engine.url) as client:
        with pytest.raises(TypeError, match="name the tasks to run with lm_eval_tasks"):
            lora_sampler.sweep(client, [], output_dir=str(tmp_path), lm_eval_limit=3)
        with pytest.raises(TypeError, match="pass no requests"):
            lora_sampler.sweep(client, [], [{"prompt": "x"}], output_dir=str(tmp_path), lm_eval_tasks="tiny_mc")
        with pytest.raises(ValueError, match="lm_eval_limit"):
            lora_sampler.sweep(client, [], output_dir=str(tmp_path), lm_eval_tasks="tiny_mc", lm_eval_args={"limit": 3})
    assert engine.calls(COMPLETIONS_PATH) == 0


@pytest.mark.timeout(1200)  # two sweeps' lm-eval runs; minutes on a loaded 2-core machine
def test_cli_sweep_kill_and_resume(tasks: Path, lora_dir: Path, tmp_path: Path) -> None:
    """Killed while the second checkpoint's tasks run: the resume evaluates it again, never the first."""
    with FakeEngine(lora_dir=lora_dir, max_model_len=64, request_overhead=0.05) as engine:
        paths = checkpoints(tmp_path / "run", engine.model, 3)
        output = tmp_path / "out"
        args = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", *paths]
        args += ["--output-dir", str(output), "--lm-eval-tasks", "tiny_mc,tiny_ppl", "--settle", "0"]
        args += ["--lm-eval-include-path", str(tasks), "--prompts-per-request", "1", "--concurrency", "2"]
        args += ["--lm-eval-args", '{"model_args": {"prefix_token_id": 1}}']
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        # The second checkpoint's warm-up goes through, its tasks' first completion is held: killed mid-task,
        # whatever the machine's speed.
        engine.hold(model=default_adapter_name(paths[1]), after=1)
        process = subprocess.Popen([sys.executable, "-m", "lora_sampler", *args], env=env, stderr=subprocess.PIPE)
        ledger = output / "sweep.jsonl"
        try:
            engine.wait_for_held(1, timeout=240)
        except TimeoutError:
            process.kill()
            pytest.fail(f"the sweep did not reach the second checkpoint's tasks: {process.communicate()[1][-2000:]!r}")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        engine.release()
        [first] = [json.loads(line) for line in ledger.read_text(encoding="utf-8").splitlines()]
        engine.reset_log()
        assert main(args) == 0
        entries = [json.loads(line) for line in ledger.read_text(encoding="utf-8").splitlines()]
        assert entries[0]["adapter"] == first["adapter"] and len(entries) == 3
        assert all("tiny_mc/acc,none" in entry["metrics"] for entry in entries)
        models = {record.model for record in engine.requests if record.path == COMPLETIONS_PATH}
        assert first["adapter"] not in models and any(str(m).startswith("step-2") for m in models)
        assert sorted(p.name for p in (output / "lm-eval").glob("*.json")) == sorted(
            e["adapter"] + ".json" for e in entries
        )


def test_lm_eval_evaluator_holds_its_requests_through_an_outage_and_says_so(
    engine: FakeEngine, tasks: Path, lora_dir: Path, checkpoint: str, tmp_path: Path
) -> None:
    """The checkpoint's outage hold (``max_outage`` and ``on_outage``) reaches lm-eval's tokenizing and scoring.

    One worker, so that one request meets every scripted drop: it fails outage-class, is held while the engine is
    probed, and runs again; ``on_outage`` hears of it. The numbers are those of a run without the outage.
    """
    attempts = RetryPolicy().max_attempts
    evaluator = LmEvalTasks(
        SweepSettings(
            str(tmp_path / "out"), lm_eval_tasks=["tiny_mc"], lm_eval_include_path=str(tasks), lm_eval_args=ARGUMENTS
        )
    )
    events: List[OutageEvent] = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as client:
        adapter = client.publish(checkpoint)
        engine.inject_fault("drop", path=TOKENIZE_PATH, count=attempts)
        engine.inject_fault("drop", path=COMPLETIONS_PATH, model=adapter.name, count=attempts)
        held = evaluator(EvaluatedCheckpoint(client, adapter, max_outage=120, on_outage=events.append))
        clean = evaluator(EvaluatedCheckpoint(client, adapter))
    kinds = [event.kind for event in events]
    assert kinds.count("held") == kinds.count("back") == 2, kinds  # the tokenize outage, then the scoring one
    assert "tiny_mc/acc,none" in held and held == clean


def test_sweep_of_lm_eval_tasks_waits_out_an_outage_with_the_sweeps_hook(
    engine: FakeEngine, tasks: Path, lora_dir: Path, checkpoint: str, tmp_path: Path
) -> None:
    """A sweep's ``max_outage``/``on_outage`` hold an lm-eval checkpoint's requests as a sampling one's."""
    events: List[OutageEvent] = []
    engine.inject_fault("drop", path=TOKENIZE_PATH, count=RetryPolicy().max_attempts)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as client:
        [report] = lora_sampler.sweep(
            client,
            [checkpoint],
            output_dir=str(tmp_path / "out"),
            lm_eval_tasks="tiny_mc",
            lm_eval_include_path=str(tasks),
            lm_eval_args=ARGUMENTS,
            max_outage=120,
            on_outage=events.append,
            settle=0,
        )
    assert report.error is None and "tiny_mc/acc,none" in report.metrics
    assert [event.kind for event in events if event.kind != "waiting"] == ["held", "back"]
