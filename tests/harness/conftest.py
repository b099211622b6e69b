"""Fixtures of the lm-eval tests: a FakeEngine, a checkpoint, and lm-eval tasks as YAML files over local JSONL.

The tasks are lm-eval's own task format (``dataset_path: json`` over files written here), so lm-eval loads them
through its real task and dataset code with no Hub (``HF_DATASETS_OFFLINE=1``; the datasets cache in the test's
folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from _lm_eval_tasks import offline_task_folder, write_task

from lora_sampler.testing import FakeEngine, set_testing, write_adapter_archive

MULTIPLE_CHOICE = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is ", "choices": ["four", "five"], "answer": 0},
    {"question": "", "choices": ["Yes", "No"], "answer": 1},
    {"question": "The sky is", "choices": [" grey", " blue"], "answer": 1},
]
GENERATION = [{"question": "Say hi", "answer": "hi"}, {"question": "Count", "answer": "1 2 3"}]
TEXTS = [
    {"text": "A long text scored in rolling windows, longer than the engine's small context. " * 2},
    {"text": "Hi."},
]


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of three tasks, one per output type: ``tiny_mc``, ``tiny_gen``, ``tiny_ppl``."""
    folder = offline_task_folder(tmp_path, monkeypatch)
    write_task(
        folder,
        "tiny_mc",
        MULTIPLE_CHOICE,
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    )
    write_task(
        folder,
        "tiny_gen",
        GENERATION,
        "output_type: generate_until\ndoc_to_text: 'Q: {{question}}\\nA:'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    )
    write_task(
        folder,
        "tiny_ppl",
        TEXTS,
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    )
    return folder


@pytest.fixture
def engine(lora_dir: Path) -> Iterator[FakeEngine]:
    """A FakeEngine with a small context (64 tokens), so that the rolling task needs several windows."""
    with set_testing(True), FakeEngine(lora_dir=lora_dir, max_model_len=64) as running:
        yield running


@pytest.fixture
def checkpoint(tmp_path: Path, engine: FakeEngine) -> str:
    return write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
