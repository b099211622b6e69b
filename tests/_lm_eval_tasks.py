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


def write_byte_tokenizer(folder: Path, shift: int = 0) -> Path:
    """A ``tokenizer.json`` of the test engine's tokenizer (UTF-8 byte ``b`` is id ``4 + b``), written with the
    ``tokenizers`` package into ``folder``, as a model folder holds it; ``shift`` moves every byte's id (another
    model's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    # The byte-level pre-tokenizer's alphabet (GPT-2's): printable bytes stand for themselves, the others from U+0100.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    chars = {byte: chr(byte) if byte in printable else chr(next(others)) for byte in range(256)}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{chars[b]: 4 + (b + shift) % 256 for b in range(256)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
