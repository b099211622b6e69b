"""What the sweep tests build and read: a training run's settled checkpoints, prompt files, a sweep's argv, and what
the sweep wrote (its ledger, its output files)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from lora_sampler.testing import write_adapter_archive

#: The steps of ``make_run``'s default training run (natural order differs from text order).
STEPS = (100, 200, 1000, 2000)


def aged(path: str, seconds: float = 60.0) -> str:
    """Set a file's times into the past: written by the training run a while ago, so it is settled."""
    past = time.time() - seconds
    os.utime(path, (past, past))
    return path


def make_run(folder: Path, model: str, steps: Tuple[int, ...] = STEPS) -> List[str]:
    """Write one distinct, settled archive ``step-N.tar.gz`` per step; return their paths in ``steps``' order."""
    folder.mkdir(exist_ok=True)
    return [
        aged(write_adapter_archive(str(folder / f"step-{step}.tar.gz"), model, rank=1 + index % 8))
        for index, step in enumerate(steps)
    ]


def write_prompts(path: Path, count: int) -> Path:
    """Write ``count`` prompt lines with ids ``p0..``."""
    with path.open("w", encoding="utf-8") as handle:
        for number in range(count):
            handle.write(json.dumps({"id": f"p{number}", "prompt": [5 + number % 200, 6, 7]}) + "\n")
    return path


def sweep_args(engine: Any, lora_dir: Path, inp: Path, out: Path, *more: str, concurrency: int = 8) -> List[str]:
    """The argv of a sweep of ``inp`` on ``engine`` (anything with a ``url``) into ``out``."""
    return [
        *("sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--input", str(inp)),
        *("--output-dir", str(out), "--concurrency", str(concurrency), *more),
    ]


def lines_of(path: Path) -> List[Dict[str, Any]]:
    """The lines of a JSONL file ([] when absent)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip()]


def ledger(out: Path) -> List[Dict[str, Any]]:
    """The lines of ``out``'s ``sweep.jsonl``; each must be whole."""
    text = (out / "sweep.jsonl").read_text()
    assert not text or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def ledger_lines(out: Path) -> int:
    """How many whole lines ``out``'s ``sweep.jsonl`` holds now (0 when absent): what a writer beside a sweep waits
    for, so a line being written is never read half."""
    path = out / "sweep.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def outputs(out: Path) -> List[Path]:
    """The output files of a sweep into ``out``: every JSONL file but the ledger."""
    return sorted(path for path in out.glob("*.jsonl") if path.name != "sweep.jsonl") if out.exists() else []


def ids_per_output(out: Path) -> Dict[str, List[Any]]:
    """The ids in each output file, by the file's name."""
    return {path.name: [record["id"] for record in lines_of(path)] for path in outputs(out)}
