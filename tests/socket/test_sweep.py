"""``lora-sampler sweep`` and ``lora_sampler.sweep`` against a FakeEngine on loopback (in process).

The issue's shell loop, redone as a sweep: natural order, every adapter unloaded at the end, one ledger line per
checkpoint, a bad checkpoint recorded while the rest are answered, the window held, resume.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from _services import require
from _sweeps import STEPS, aged, ids_per_output, ledger, make_run, sweep_args, write_prompts
from _waits import wait_until

from lora_sampler import SamplerClient, sweep
from lora_sampler._adapters.publish import default_adapter_name
from lora_sampler.batch import Sweep, SweepSettings
from lora_sampler.batch._sources import Manifest
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive
from lora_sampler.types import SampleRequest, SamplingParams

COMPLETIONS = "/v1/completions"


@pytest.fixture
def engine_options() -> Dict[str, Any]:
    """Every request takes a little engine time, so checkpoints overlap as they would on a real engine."""
    return {"latency": 0.002}


@contextlib.contextmanager
def released_once_answered(engine: FakeEngine, model: str) -> Iterator[None]:
    """For the block: release ``engine``'s hold as soon as a completion for ``model`` was answered (a held one went on:
    the overlap it waited for happened), after the common deadline, or at the block's end, whichever comes first; a
    deadline passed fails the test after the block."""
    ended, failures = threading.Event(), []

    def release() -> None:
        try:
            wait_until(lambda: ended.is_set() or engine.calls(COMPLETIONS, model) >= 1, f"an answer for {model}")
        except AssertionError as error:
            failures.append(error)
        finally:
            engine.release()

    releaser = threading.Thread(target=release, name="test-release")
    releaser.start()
    try:
        yield
    finally:
        ended.set()
        releaser.join()
    if failures:
        raise failures[0]


def test_sweep_takes_checkpoints_in_natural_order_and_unloads_each(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's loop as one sweep: step-200 before step-1000, every row once, nothing left loaded, a table."""
    make_run(tmp_path / "run", engine.model)
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 50), tmp_path / "out"
    pattern = str(tmp_path / "run" / "step-*.tar.gz")
    assert main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", pattern, "--window", "1")) == 0
    lines = ledger(out)
    assert [line["step"] for line in lines] == list(STEPS)
    assert all(line["rows"] == 50 and line["failed"] == 0 and line["tokens"] == 50 * 16 for line in lines)
    assert set(lines[0]) == {
        "checkpoint",
        "adapter",
        "output",
        "rows",
        "failed",
        "tokens",
        "mean_logprob",
        "mean_length",
        "seconds",
        "step",
        "path",
        "signature",
    }
    assert lines[0]["path"] == os.path.realpath(lines[0]["checkpoint"])
    outputs = ids_per_output(out)
    assert sorted(outputs) == sorted(line["output"] for line in lines)
    assert all(sorted(ids) == sorted(f"p{n}" for n in range(50)) for ids in outputs.values())
    served = [r.model for r in engine.requests if r.path == COMPLETIONS]
    first_seen = list(dict.fromkeys(served))
    assert first_seen == [line["adapter"] for line in lines]  # window 1: one checkpoint after the other
    assert engine.loaded_adapters == []  # each unloaded once done
    table = capsys.readouterr().out
    assert "mean logprob" in table and "step-1000.tar.gz" in table


def test_sweep_window_bounds_the_checkpoints_in_flight(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """From the engine's request log: never more than --window adapters with completions in flight at once."""
    engine = make_engine(latency=0.005)
    steps = make_run(tmp_path / "run", engine.model, (1, 2, 3, 4, 5, 6))
    first, second = default_adapter_name(steps[0]), default_adapter_name(steps[1])
    # step-1's completions wait until one of step-2's is in flight beside them, so the overlap the window allows
    # happens whatever the machine's speed (unheld, a slow machine could end step-1 before step-2 sent anything).
    # Once one of step-1's is answered the overlap happened, and nothing more is held. One prompt a request and 16
    # workers: step-1's 13 requests (its warm-up and 12 rows) are all sent without waiting for an answer, so its
    # input ends and step-2's requests (on the 3 workers left) come even while all of step-1's are held.
    engine.hold(model=first, beside=second)
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 12), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--quiet")
    with released_once_answered(engine, first):
        assert main([*argv, "--window", "2", "--prompts-per-request", "1", "--concurrency", "16"]) == 0
    spans = [(r.started, r.finished, r.model) for r in engine.requests if r.path == COMPLETIONS]
    most = 0
    for start, _, _ in spans:
        at_once = {model for s, f, model in spans if s <= start < f}
        most = max(most, len(at_once))
    assert most == 2  # the next checkpoint starts during the last rows of the previous one, never a third
    assert len(ledger(out)) == 6


def test_sweep_records_a_bad_checkpoint_and_answers_the_rest(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A corrupt archive and one for another base model, in the middle: each recorded with its error, exit 1."""
    run = tmp_path / "run"
    make_run(run, engine.model, (100, 400))
    aged(write_adapter_archive(str(run / "step-300.tar.gz"), "another/model", rank=3))
    (run / "step-200.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    aged(str(run / "step-200.tar.gz"))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 20), tmp_path / "out"
    assert main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet")) == 1
    by_step = {os.path.basename(line["checkpoint"]): line for line in ledger(out)}
    assert len(by_step) == 4
    assert by_step["step-200.tar.gz"]["error"]["type"] == "IncompleteCheckpointError"
    assert by_step["step-300.tar.gz"]["error"]["type"] == "AdapterConfigError"
    assert "another/model" in by_step["step-300.tar.gz"]["error"]["message"]
    assert by_step["step-100.tar.gz"]["rows"] == by_step["step-400.tar.gz"]["rows"] == 20


def test_sweep_resume_skips_finished_and_retries_failed_checkpoints(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Run again after fixing the bad checkpoint: only it runs, and the ledger has one line per checkpoint."""
    run = tmp_path / "run"
    make_run(run, engine.model, (1, 3))
    broken = run / "step-2.tar.gz"
    broken.write_bytes(b"garbage")
    aged(str(broken))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 30), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--checkpoints", str(run / "*.tar.gz"), "--quiet")
    assert main(argv) == 1
    broken.unlink()
    aged(write_adapter_archive(str(broken), engine.model, rank=5))
    engine.reset_log()
    assert main(argv) == 0
    assert {r.model for r in engine.requests if r.path == COMPLETIONS} == {ledger(out)[-1]["adapter"]}
    lines = ledger(out)
    assert sorted(os.path.basename(line["checkpoint"]) for line in lines) == [
        "step-1.tar.gz",
        "step-2.tar.gz",
        "step-3.tar.gz",
    ]
    assert all("error" not in line and line["rows"] == 30 for line in lines)
    engine.reset_log()
    assert main(argv) == 0  # everything done: nothing is sent
    assert engine.calls(COMPLETIONS) == 0 and len(ledger(out)) == 3


def test_sweep_keep_loaded_and_delete_retired(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """--keep-loaded leaves every adapter on the engine; --delete-retired removes the unloaded adapters' folders."""
    make_run(tmp_path / "run", engine.model, (1, 2))
    inp = write_prompts(tmp_path / "prompts.jsonl", 10)
    pattern = str(tmp_path / "run" / "*.tar.gz")
    kept = sweep_args(engine, lora_dir, inp, tmp_path / "kept", "--checkpoints", pattern, "--quiet", "--keep-loaded")
    assert main(kept) == 0
    names = [line["adapter"] for line in ledger(tmp_path / "kept")]
    assert sorted(engine.loaded_adapters) == sorted(names)
    for name in names:
        engine_unload = main(["unload", "--base-url", engine.url, name])
        assert engine_unload == 0
    deleted = sweep_args(engine, lora_dir, inp, tmp_path / "deleted", "--checkpoints", pattern, "--quiet")
    assert main([*deleted, "--delete-retired"]) == 0
    assert engine.loaded_adapters == [] and not any((lora_dir / name).exists() for name in names)


def test_sweep_reads_a_manifest_in_file_order(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A manifest's checkpoints are taken in its order, state-only lines skipped, its step recorded."""
    archives = make_run(tmp_path / "run", engine.model, (5, 7))
    manifest = tmp_path / "run" / "checkpoints.jsonl"
    manifest.write_text(
        json.dumps({"name": "b", "batch": 70, "sampler_path": os.path.basename(archives[1])})
        + "\n"
        + json.dumps({"name": "state", "batch": 70, "state_path": "tinker://state"})
        + "\n"
        + json.dumps({"name": "a", "batch": 50, "sampler_path": archives[0], "final": True})
        + "\n"
    )
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 10), tmp_path / "out"
    argv = sweep_args(engine, lora_dir, inp, out, "--manifest", str(manifest), "--quiet", "--window", "1")
    assert main(argv) == 0
    assert [(line["checkpoint"], line["step"]) for line in ledger(out)] == [(archives[1], 70), (archives[0], 50)]


def test_client_sweep_yields_a_report_per_checkpoint(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """lora_sampler.sweep from Python: requests as mappings or SampleRequest values, one report per checkpoint."""
    make_run(tmp_path / "run", engine.model, (10, 20))
    own = SampleRequest([7, 8], base_model="replaced", sampling_params=SamplingParams(max_tokens=5))
    requests: List[Any] = [{"id": "a", "prompt": [5, 6]}, own]  # a SampleRequest keeps its own parameters
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=4) as client:
        reports = list(
            sweep(
                client,
                str(tmp_path / "run" / "*.tar.gz"),
                requests,
                output_dir=tmp_path / "out",
                sampling_params=SamplingParams(max_tokens=3),
            )
        )
    reports.sort(key=lambda r: r.step or 0)  # in the order they finished: with a window of 2, either may be first
    assert [r.step for r in reports] == [10, 20] and all(r.ok and r.rows == 2 for r in reports)
    assert [(r.mean_length, r.tokens) for r in reports] == [(4, 8), (4, 8)], reports
    output = (tmp_path / "out" / str(reports[0].output)).read_text().splitlines()
    assert sorted(json.dumps(json.loads(line)["id"]) for line in output) == ['"a"', "2"]
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        again = list(
            sweep(
                client,
                Manifest(str(tmp_path / "none.jsonl")),
                requests,
                output_dir=tmp_path / "out",
                sampling_params=SamplingParams(max_tokens=3),  # the same settings: other ones are refused
            )
        )
    # The ledger covers them (re-yielded from it, marked resumed) and a missing manifest names nothing new.
    assert sorted((r.step, r.rows, r.resumed) for r in again) == [(10, 2, True), (20, 2, True)]
    assert [r.ledger_line() for r in sorted(again, key=lambda r: r.step or 0)] == [r.ledger_line() for r in reports]


def test_sweep_refuses_openai_batch_input_and_missing_patterns(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Usage errors name the problem: batch lines name their own models; a pattern matching nothing."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {}}) + "\n")
    pattern = str(tmp_path / "none" / "*.tar.gz")
    assert main(sweep_args(engine, lora_dir, batch, tmp_path / "out", "--checkpoints", pattern)) == 2
    assert "OpenAI batch lines" in capsys.readouterr().err
    inp = write_prompts(tmp_path / "prompts.jsonl", 3)
    assert main(sweep_args(engine, lora_dir, inp, tmp_path / "out", "--checkpoints", pattern)) == 2
    assert "names no checkpoint" in capsys.readouterr().err


def test_sweep_plot_draws_a_png(engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None) -> None:
    """--plot FILE.png writes a PNG of the per-checkpoint means."""
    require("matplotlib", "install the plot extra: pip install 'lora_sampler[plot]' (the tox envs have it)")
    make_run(tmp_path / "run", engine.model, (1, 2))
    inp, plot = write_prompts(tmp_path / "prompts.jsonl", 5), tmp_path / "means.png"
    argv = sweep_args(engine, lora_dir, inp, tmp_path / "out", "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
    assert main([*argv, "--quiet", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_sweep_plot_without_matplotlib_names_the_extra(
    engine: FakeEngine,
    lora_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without matplotlib, --plot is refused before any request, naming the plot extra."""
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    make_run(tmp_path / "run", engine.model, (1,))
    inp = write_prompts(tmp_path / "prompts.jsonl", 5)
    argv = sweep_args(engine, lora_dir, inp, tmp_path / "out", "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
    assert main([*argv, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'lora_sampler[plot]'" in capsys.readouterr().err
    assert engine.calls(COMPLETIONS) == 0


def test_sweep_over_a_fleet_loads_and_unloads_every_replica(lora_dir: Path, tmp_path: Path, no_waits: None) -> None:
    """--replicas: each checkpoint is loaded on every replica (no resolver) and unloaded from every one at the end."""
    replicas = [FakeEngine(latency=0.002).start() for _ in range(2)]  # no lora_dir: served only once loaded
    try:
        make_run(tmp_path / "run", replicas[0].model, (1, 2, 3))
        inp, out = write_prompts(tmp_path / "prompts.jsonl", 20), tmp_path / "out"
        argv = sweep_args(replicas[0], lora_dir, inp, out, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
        assert main([*argv, "--quiet", "--replicas", ",".join(e.url for e in replicas)]) == 0
        names = [line["adapter"] for line in ledger(out)]
        assert len(names) == 3 and all(line["rows"] == 20 for line in ledger(out))
        for engine in replicas:
            assert engine.loaded_adapters == []
            assert all(engine.calls("/v1/load_lora_adapter", name) >= 1 for name in names)
            assert all(engine.calls("/v1/unload_lora_adapter", name) == 1 for name in names)
    finally:
        for engine in replicas:
            engine.stop()


def test_sweep_two_checkpoints_with_the_same_content_answer_each_id_once(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The same checkpoint under two runs is one adapter and one output file: its rows are sent and written once."""
    first = make_run(tmp_path / "run-a", engine.model, (5,))[0]
    (tmp_path / "run-b").mkdir()
    copy = tmp_path / "run-b" / "step-5.tar.gz"
    copy.write_bytes(Path(first).read_bytes())
    aged(str(copy))
    inp, out = write_prompts(tmp_path / "prompts.jsonl", 30), tmp_path / "out"
    pattern = str(tmp_path / "run-*" / "step-5.tar.gz")
    assert main(sweep_args(engine, lora_dir, inp, out, "--checkpoints", pattern, "--quiet")) == 0
    lines = ledger(out)
    assert len(lines) == 2 and lines[0]["adapter"] == lines[1]["adapter"]
    assert lines[0]["rows"] == lines[1]["rows"] == 30
    assert engine.calls(COMPLETIONS, lines[0]["adapter"]) <= 30 + 2  # the rows once, plus at most two warm-ups
    assert sorted(ids_per_output(out)[lines[0]["output"]]) == sorted(f"p{n}" for n in range(30))


def test_a_sweep_stopped_at_once_leaves_its_held_warm_ups_behind(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """``Sweep.stop(0.0)`` while the engine holds every request, the checkpoints' warm-ups included, ends the sweep at
    once and resumably (was: each checkpoint's thread joined its held warm-up, so the sweep waited for the client's
    read timeout, 600 s here); the run afterwards answers every id once."""
    make_run(tmp_path / "run", engine.model, (1, 2, 3))
    pattern, out = str(tmp_path / "run" / "*.tar.gz"), tmp_path / "out"
    prompts = [{"id": number, "prompt": [5 + number, 6]} for number in range(8)]
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=2, timeout=(10, 600)) as client:
        running = Sweep(client, pattern, prompts, SweepSettings(output_dir=str(out), window=2))
        reports: List[Any] = []
        thread = threading.Thread(target=lambda: reports.extend(running.run()), daemon=True)
        engine.hold()
        try:
            thread.start()
            engine.wait_for_held(2)
            running.stop(0.0)
            thread.join(60)
            waited = thread.is_alive()
        finally:
            engine.release()
        assert not waited, "the stopped sweep still waits for a held request"
        # No report: nothing finished. The two held requests may be both checkpoints' warm-ups (no job started, so
        # none abandoned) or a warm-up and a job's first request: ``abandoned`` depends on which, so not asserted.
        assert reports == []
        again = list(sweep(client, pattern, prompts, output_dir=out, window=2))
    assert [(report.rows, report.failed) for report in again] == [(8, 0)] * 3
    assert all(sorted(ids) == list(range(8)) for ids in ids_per_output(out).values())


def test_a_sweep_stopped_at_once_while_two_checkpoints_share_an_adapter_leaves_another_thread_s_request_alone(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Two checkpoints with the same bytes (one adapter, one output; the second waits for the first's end) and
    another thread scoring on the same client, held by the engine: the sweep's requests wait for it (scoring
    isolation); ``Sweep.stop(0.0)`` then ends the sweep (the second checkpoint's wait for the first included) and cuts
    none of the other thread's requests; the run afterwards answers every id once for both checkpoints."""
    first = make_run(tmp_path / "run-a", engine.model, (5,))[0]
    (tmp_path / "run-b").mkdir()
    copy = tmp_path / "run-b" / "step-5.tar.gz"
    copy.write_bytes(Path(first).read_bytes())
    aged(str(copy))
    pattern, out = str(tmp_path / "run-*" / "step-5.tar.gz"), tmp_path / "out"
    prompts = [{"id": number, "prompt": [5 + number, 6]} for number in range(8)]
    scored: List[Any] = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=4, timeout=(10, 600)) as client:
        running = Sweep(client, pattern, prompts, SweepSettings(output_dir=str(out), window=2))
        reports: List[Any] = []
        thread = threading.Thread(target=lambda: reports.extend(running.run()), daemon=True)
        scorer = threading.Thread(
            target=lambda: scored.append(client.compute_logprobs([5, 6, 7], base_model=engine.model)), daemon=True
        )
        engine.hold()
        try:
            scorer.start()
            engine.wait_for_held(1)  # the other thread's request is in flight
            thread.start()
            wait_until(lambda: client.isolation.waits >= 1, "a sweep request waiting for the scoring one")
            running.stop(0.0)
            thread.join(60)
            waited = thread.is_alive()
        finally:
            engine.release()
        scorer.join(60)
        assert not waited, "the stopped sweep still waits"
        assert not scorer.is_alive() and len(scored) == 1 and len(scored[0]) == 3, "the other thread's request was cut"
        # No report: nothing finished. Whether a job had started (and so abandoned requests) when the stop came
        # depends on which sweep request was waiting for the scoring one (the warm-up, or a job's), so not asserted.
        assert reports == []
        again = list(sweep(client, pattern, prompts, output_dir=out, window=2))
    assert [(report.rows, report.failed) for report in again] == [(8, 0)] * 2
    assert again[0].adapter == again[1].adapter
    assert [sorted(ids) for ids in ids_per_output(out).values()] == [list(range(8))]
