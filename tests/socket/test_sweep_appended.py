"""A sweep run again after lines were appended to its input answers them on every checkpoint an earlier run
finished, and sends nothing already answered (docs/contract.md: lines appended to the input are new work)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lora_sampler import SamplerClient, sweep
from lora_sampler.batch._sources import Manifest
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive

COMPLETIONS = "/v1/completions"


def _run(folder: Path, model: str, steps: int = 2) -> List[str]:
    """Write ``steps`` distinct, settled archives (written a while ago by the training run)."""
    folder.mkdir(exist_ok=True)
    paths = []
    for step in range(1, steps + 1):
        path = write_adapter_archive(str(folder / f"step-{step}.tar.gz"), model, rank=step)
        past = time.time() - 60
        os.utime(path, (past, past))
        paths.append(path)
    return paths


def _append(path: Path, first: int, count: int) -> None:
    with path.open("a", encoding="utf-8") as handle:
        for number in range(first, first + count):
            handle.write(json.dumps({"id": f"p{number}", "prompt": [5 + number, 6, 7]}) + "\n")


def _ledger(out: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def _ids(out: Path, name: str) -> List[str]:
    return [json.loads(line)["id"] for line in (out / name).read_text().splitlines()]


def _prompts_sent(engine: FakeEngine, model: str) -> int:
    """How many prompts ``model`` was asked, however they were grouped into requests."""
    return sum(r.prompts for r in engine.requests if r.path == COMPLETIONS and r.model == model)


@pytest.fixture
def argv(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> List[str]:
    _run(tmp_path / "run", engine.model)
    inp = tmp_path / "prompts.jsonl"
    _append(inp, 0, 6)
    return [
        "sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp),
        "--output-dir", str(tmp_path / "out"), "--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--quiet",
    ]  # fmt: skip


def test_a_rerun_answers_only_the_appended_lines_on_finished_checkpoints(
    engine: FakeEngine, argv: List[str], tmp_path: Path, no_waits: None
) -> None:
    out, inp = tmp_path / "out", tmp_path / "prompts.jsonl"
    assert main(argv) == 0
    adapters = [line["adapter"] for line in _ledger(out)]
    assert len(adapters) == 2
    answered = {line["output"]: (out / line["output"]).read_text() for line in _ledger(out)}
    _append(inp, 6, 3)
    engine.reset_log()
    assert main(argv) == 0
    for adapter in adapters:  # the three appended prompts only (and the warm-up's, the first of them cut to one
        assert _prompts_sent(engine, adapter) == 3 + 1  # token); none of the six answered before
    lines = _ledger(out)
    assert [line["adapter"] for line in lines] == adapters  # one line per checkpoint, updated in place
    for line in lines:
        assert line["rows"] == 9 and line["failed"] == 0
        text = (out / line["output"]).read_text()
        assert text.startswith(answered[line["output"]])  # the earlier rows as they were
        assert sorted(_ids(out, line["output"])) == sorted(f"p{n}" for n in range(9))  # each id once
    engine.reset_log()
    assert main(argv) == 0  # nothing new: nothing is sent
    assert engine.calls(COMPLETIONS) == 0 and len(_ledger(out)) == 2


def test_a_rerun_with_an_appended_duplicate_id_is_refused_naming_it(
    engine: FakeEngine, argv: List[str], tmp_path: Path, no_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out, inp = tmp_path / "out", tmp_path / "prompts.jsonl"
    assert main(argv) == 0
    before = (out / "sweep.jsonl").read_bytes()
    _append(inp, 2, 1)  # p2 again
    engine.reset_log()
    assert main(argv) == 2  # as sample (below)
    assert "line 7 repeats the id 'p2' of line 3" in capsys.readouterr().err
    assert engine.calls(COMPLETIONS) == 0 and (out / "sweep.jsonl").read_bytes() == before


def test_a_rerun_on_a_shrunk_input_keeps_the_answers_of_removed_ids(
    engine: FakeEngine, argv: List[str], tmp_path: Path, no_waits: None
) -> None:
    """As ``sample``: an id no longer in the input keeps its row; nothing is sent, the ledger stays."""
    out, inp = tmp_path / "out", tmp_path / "prompts.jsonl"
    assert main(argv) == 0
    before = (out / "sweep.jsonl").read_bytes()
    inp.write_text("".join(inp.read_text().splitlines(keepends=True)[:3]))
    engine.reset_log()
    assert main(argv) == 0
    assert engine.calls(COMPLETIONS) == 0 and (out / "sweep.jsonl").read_bytes() == before
    assert all(len(_ids(out, line["output"])) == 6 for line in _ledger(out))


def test_sample_refuses_an_appended_duplicate_id_alike(
    engine: FakeEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``sample`` does with a repeated id appended to an answered input (the sweep does the same)."""
    inp, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    _append(inp, 0, 6)
    argv = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp), "--output", str(out)]
    assert main([*argv, "--quiet"]) == 0
    _append(inp, 2, 1)
    engine.reset_log()
    assert main([*argv, "--quiet"]) == 2
    assert "line 7 repeats the id 'p2' of line 3" in capsys.readouterr().err
    assert engine.calls(COMPLETIONS) == 0


def test_python_sweep_yields_each_checkpoint_once_after_an_append(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """A re-run cell: the checkpoints resumed for appended lines come once each, fresh (not re-read from the ledger),
    with their rows counted over the whole output; a checkpoint no longer listed comes as the ledger holds it."""
    _run(tmp_path / "run", engine.model)
    requests: List[Any] = [{"id": "a", "prompt": [5, 6]}]
    pattern = str(tmp_path / "run" / "*.tar.gz")
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        first = list(sweep(client, pattern, requests, output_dir=tmp_path / "out"))
        requests.append({"id": "b", "prompt": [7, 8]})
        again = list(sweep(client, pattern, requests, output_dir=tmp_path / "out"))
        requests.append({"id": "c", "prompt": [9]})
        gone = list(sweep(client, Manifest(str(tmp_path / "none.jsonl")), requests, output_dir=tmp_path / "out"))
    assert sorted((r.step, r.rows, r.resumed) for r in first) == [(1, 1, False), (2, 1, False)]
    assert sorted((r.step, r.rows, r.resumed) for r in again) == [(1, 2, False), (2, 2, False)]
    assert sorted((r.step, r.rows, r.resumed) for r in gone) == [(1, 2, True), (2, 2, True)]


def test_lines_appended_while_a_watch_runs_reach_later_checkpoints_and_the_rest_on_the_next_run(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The input is read afresh for each checkpoint: one started after the append answers the new lines at once; one
    finished before it lacks them until the next run, which sends those only."""
    run, inp, out = tmp_path / "run", tmp_path / "prompts.jsonl", tmp_path / "out"
    _run(run, engine.model, steps=1)
    _append(inp, 0, 4)
    pattern = str(run / "*.tar.gz")
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = []
        for report in sweep(client, pattern, str(inp), output_dir=out, watch=True, idle_timeout=60):
            reports.append(report)
            if len(reports) == 2:
                break  # ends the watch
            _append(inp, 4, 2)  # the first checkpoint is finished: now the line and the next checkpoint
            path = write_adapter_archive(str(run / "step-2.tar.gz"), engine.model, rank=2)
            os.utime(path, (time.time() - 60, time.time() - 60))
        assert [(r.step, r.rows) for r in reports] == [(1, 4), (2, 6)]
        engine.reset_log()
        again = list(sweep(client, pattern, str(inp), output_dir=out))
    assert sorted((r.step, r.rows, r.resumed) for r in again) == [(1, 6, False), (2, 6, True)]
    assert _prompts_sent(engine, reports[0].adapter) == 2 + 1  # the two appended (and the warm-up's)
    assert _prompts_sent(engine, reports[1].adapter) == 0
