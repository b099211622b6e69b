"""lm-eval task files written by the tests: a task YAML over a local JSONL (``dataset_path: json``, no Hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest


def write_task(folder: Path, name: str, rows: List[Dict[str, Any]], body: str) -> None:
    """Write ``rows`` as ``<name>.jsonl`` and the task ``<name>.yaml`` reading it (``body``: the task's own keys)."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / f"{name}.yaml").write_text(head + body, encoding="utf-8")


def offline_task_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``tasks`` folder under ``tmp_path``; lm-eval reads datasets offline, its cache in the test's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "tasks"
    folder.mkdir()
    return folder
