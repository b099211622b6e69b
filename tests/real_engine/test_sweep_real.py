"""``lora-sampler sweep`` on the real vLLM started with ``--max-loras 1``: one adapter per batch, as in production.

Three checkpoints of a run (two built adapters and a third with different files), each answered, each unloaded at
the end, the engine still serving. The engine is started for this test and stopped after it (conftest runs it before
the shared engine starts, so one engine runs at a time).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List

import pytest

from lora_sampler.cli import main

if TYPE_CHECKING:
    from conftest import RealEngine

PROMPTS = 12


def _lines(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sweep_real_three_adapters_on_max_loras_one(
    vllm_engine_one_lora: RealEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep over three adapters with --max-loras 1: every row answered by its adapter, all unloaded, engine up."""
    engine = vllm_engine_one_lora
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", engine.api_key)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(engine.adapter_dirs[0], run / "step-100")
    shutil.copytree(engine.adapter_dirs[1], run / "step-200")
    shutil.copytree(engine.adapter_dirs[0], run / "step-1000")
    # Another adapter: its config differs (dropout, which inference ignores). Other files in the folder would not do:
    # only the adapter's own files are published and hashed, so a copy with a README is the same checkpoint content.
    config = json.loads((run / "step-1000" / "adapter_config.json").read_text())
    config["lora_dropout"] = 0.05
    (run / "step-1000" / "adapter_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": n, "prompt": [1, 5 + n, 9]}) + "\n" for n in range(PROMPTS)))
    out = tmp_path / "out"
    argv = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(engine.lora_dir), "--input", str(prompts)]
    argv += ["--output-dir", str(out), "--checkpoints", str(run / "step-*"), "--concurrency", "4", "--max-tokens", "4"]
    assert main([*argv, "--quiet", "--settle", "0", "--temperature", "0"]) == 0
    ledger = _lines(out / "sweep.jsonl")
    # sweep.jsonl lists checkpoints in the order they finished (the contract): with a window of 2, step-200 may finish
    # before step-100 on a busy machine; each checkpoint has exactly one line.
    assert sorted(line["step"] for line in ledger) == [100, 200, 1000]
    assert all(line["rows"] == PROMPTS and line["failed"] == 0 and line["tokens"] == PROMPTS * 4 for line in ledger)
    for line in ledger:
        records = _lines(out / line["output"])
        assert sorted(record["id"] for record in records) == list(range(PROMPTS))
        assert {record["model"] for record in records} == {line["adapter"]}
    listed = engine.session.get(f"{engine.url}/v1/models", headers=engine.headers(), timeout=30).json()
    names = {card["id"] for card in listed["data"]}
    assert not names & {line["adapter"] for line in ledger}  # each unloaded once its checkpoint was done
    assert engine.session.get(f"{engine.url}/health", timeout=30).status_code == 200
    assert engine.complete(engine.model).status_code == 200  # the engine still serves
