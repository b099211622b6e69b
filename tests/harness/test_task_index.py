"""The sweep's lm-eval task index: of the task folder alone when it holds every task named, else lm-eval's whole one.

lm-eval's whole index reads every task YAML it ships (about 10 s of CPU, 39 s on a loaded 2-core machine), which a
sweep over the user's own tasks does not need; a group, or a task lm-eval ships, does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import lm_eval.tasks
import pytest

from lora_sampler import SamplerClient, SweepSettings
from lora_sampler.batch import EvaluatedCheckpoint
from lora_sampler.lm_eval import LmEvalTasks
from lora_sampler.testing import FakeEngine

ARGUMENTS = {"bootstrap_iters": 0, "model_args": {"prefix_token_id": 1}}


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> List[Dict[str, Any]]:
    """The arguments of every lm-eval task index built (lm-eval's own ``TaskManager``, recorded as it is built)."""
    calls: List[Dict[str, Any]] = []
    real = lm_eval.tasks.TaskManager

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", recorded)
    return calls


def write_group(folder: Path) -> None:
    """A group of the folder's own multiple-choice task."""
    (folder / "tiny_group.yaml").write_text("group: tiny_group\ntask:\n  - tiny_mc\n", encoding="utf-8")


def evaluate(engine: FakeEngine, tasks: Path, names: List[str], checkpoint: str, tmp_path: Path) -> Dict[str, float]:
    """The tasks on one checkpoint, twice (as a sweep's two checkpoints): the same numbers each time."""
    evaluator = LmEvalTasks(
        SweepSettings(
            str(tmp_path / "out"), lm_eval_tasks=names, lm_eval_include_path=str(tasks), lm_eval_args=ARGUMENTS
        )
    )
    with SamplerClient(engine.url, lora_base_dir=engine.lora_dir) as client:
        adapter = client.publish(checkpoint)
        first = evaluator(EvaluatedCheckpoint(client, adapter))
        again = evaluator(EvaluatedCheckpoint(client, adapter))
    assert first == again
    return first


def test_tasks_of_the_folder_are_found_in_its_own_index_built_once(
    engine: FakeEngine, tasks: Path, checkpoint: str, tmp_path: Path, built: List[Dict[str, Any]]
) -> None:
    """Two evaluations, the folder's tasks: one index, of the folder alone."""
    metrics = evaluate(engine, tasks, ["tiny_mc", "tiny_gen"], checkpoint, tmp_path)
    assert built == [{"include_path": str(tasks), "include_defaults": False}]
    assert {"tiny_mc/acc,none", "tiny_gen/exact_match,none"} <= set(metrics)


@pytest.mark.timeout(1200)  # lm-eval's whole index: tens of seconds on a loaded 2-core machine
def test_a_group_builds_lm_evals_whole_index_with_the_folder(
    engine: FakeEngine, tasks: Path, checkpoint: str, tmp_path: Path, built: List[Dict[str, Any]]
) -> None:
    """A group (it may name lm-eval's own tasks) is looked up in lm-eval's whole index, the folder included."""
    write_group(tasks)
    metrics = evaluate(engine, tasks, ["tiny_group"], checkpoint, tmp_path)
    assert built[-1] == {"include_path": str(tasks)} and len(built) == 2  # the folder's, then the whole one, once
    assert "tiny_mc/acc,none" in metrics
