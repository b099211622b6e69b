"""``lora-sampler sweep --score`` and ``lora_sampler.sweep(..., score=True)``: every checkpoint scored, not sampled.

Each checkpoint's output holds ``score``'s records; ``sweep.jsonl`` carries ``mean_logprob`` (per scored token) and
``mean_sum`` (per line: the held-out log-likelihood), equal to what its output file says; a resume sends nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from _sweeps import ledger, make_run, sweep_args

from lora_sampler import SamplerClient, ScoreRequest, sweep
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine

COMPLETIONS = "/v1/completions"
LINES = [
    {"id": "q1", "prompt": "Q: 2+2? A:", "completion": " 4"},
    {"id": "q2", "prompt": [5, 6, 7, 8]},
    {"id": "q3", "prompt": "The cat", "completion": " sat down"},
]


def expected_means(records: List[Dict[str, Any]]) -> Dict[str, float]:
    """The means a ledger line must give for these score records."""
    tokens = sum(len(r["tokens"]) for r in records)
    total = sum(r["sum"] for r in records)
    return {"mean_logprob": total / tokens, "mean_sum": total / len(records), "mean_length": tokens / len(records)}


def test_sweep_score_scores_every_checkpoint_with_per_line_means(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None, capsys: Any
) -> None:
    """Three checkpoints scored: score records per output, mean_logprob and mean_sum in sweep.jsonl and the table."""
    make_run(tmp_path / "run", engine.model, (100, 200, 1000))
    inp, out = tmp_path / "heldout.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    argv = sweep_args(engine, lora_dir, inp, out, "--score", "--checkpoints", str(tmp_path / "run" / "*.tar.gz"))
    assert main(argv) == 0
    entries = sorted(ledger(out), key=lambda entry: entry["step"])
    assert [entry["step"] for entry in entries] == [100, 200, 1000]
    for entry in entries:
        records = [json.loads(line) for line in (out / entry["output"]).read_text().splitlines()]
        assert sorted(r["id"] for r in records) == ["q1", "q2", "q3"] and all("sum" in r for r in records)
        assert (
            entry["rows"] == 3 and entry["failed"] == 0 and entry["tokens"] == 2 + 3 + 9
        )  # " 4", the ids after the first, " sat down"
        for key, value in expected_means(records).items():
            assert abs(entry[key] - value) < 1e-9, (key, entry)
    assert len({entry["mean_sum"] for entry in entries}) == 3  # each checkpoint's own logprobs
    table = capsys.readouterr().out
    assert "mean sum" in table.splitlines()[0] and "step-1000" in table
    engine.reset_log()
    assert main(argv) == 0 and engine.calls(COMPLETIONS) == 0  # resumed: every checkpoint is finished
    assert len(ledger(out)) == 3


def test_client_sweep_score_takes_score_requests(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """lora_sampler.sweep(score=True) with ScoreRequest values and mappings: reports carry a typed mean_sum."""
    make_run(tmp_path / "run", engine.model, (10, 20))
    requests: List[Any] = [
        ScoreRequest([5, 6, 7], base_model="replaced"),
        {"id": "m", "prompt": "ab", "completion": "c"},
    ]
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=4) as client:
        reports = list(
            sweep(client, str(tmp_path / "run" / "*.tar.gz"), requests, output_dir=tmp_path / "o", score=True)
        )
    assert sorted(r.step or 0 for r in reports) == [10, 20] and all(r.ok and r.rows == 2 for r in reports)
    for report in reports:
        records = [json.loads(line) for line in (tmp_path / "o" / str(report.output)).read_text().splitlines()]
        assert {json.dumps(r["id"]): r["tokens"] for r in records} == {"1": [6, 7], '"m"': [4 + ord("c")]}
        assert report.tokens == 3 and report.mean_sum is not None
        assert abs(report.mean_sum - expected_means(records)["mean_sum"]) < 1e-9 and "mean_sum" not in report.extra
