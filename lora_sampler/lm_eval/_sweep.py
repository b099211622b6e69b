"""lm-eval's tasks on every checkpoint of a sweep: ``LmEvalTasks``, a ``CheckpointEvaluator``.

The sweep hands it its client and each checkpoint's adapter (an ``EvaluatedCheckpoint``); it runs lm-eval's
``simple_evaluate`` on a ``LoraSamplerLM`` over them, keeps lm-eval's results JSON under
``<output_dir>/lm-eval/<adapter>.json`` and returns every number lm-eval reports for a task as ``<task>/<key>``
with lm-eval's own key (``hellaswag/acc_norm,none``). One ``TokenCache`` serves every checkpoint (the tokenizer is
the base model's), and lm-eval's task index is built once per sweep (of ``include_path`` alone when it holds every
task named). A checkpoint is the unit of resume: its results
JSON is written whole before its ledger line.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Dict, Mapping, Optional

from lora_sampler._files import replacing
from lora_sampler.batch._evaluator import CheckpointEvaluator, EvaluatedCheckpoint
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.lm_eval._model import LoraSamplerLM
from lora_sampler.lm_eval._tokens import TokenCache, local_tokenizer

#: The folder under the sweep's output folder that holds lm-eval's results, one JSON per checkpoint.
RESULTS_FOLDER = "lm-eval"
#: simple_evaluate arguments the sweep sets itself (a task list, the model): not taken from ``lm_eval_args``.
OWN_ARGUMENTS = ("model", "tasks", "task_manager", "limit", "num_fewshot")
#: What ``lm_eval_args["model_args"]`` may set on each checkpoint's model (the rest is the sweep's client's).
MODEL_SETTINGS = ("prefix_token_id", "max_length", "max_gen_toks", "tokenizer")


class LmEvalTasks(CheckpointEvaluator):
    """Run lm-eval tasks on each checkpoint; its metrics are every number lm-eval reports, as ``<task>/<key>``.

    Args:
        settings: The sweep's settings, read as they are: ``lm_eval_tasks`` (task or group names),
            ``lm_eval_include_path`` (a folder of task YAMLs of your own), ``lm_eval_limit`` (the first N documents
            of each task; below 1, a fraction), ``lm_eval_num_fewshot``, ``output_dir`` (lm-eval's results go to
            ``<output_dir>/lm-eval/<adapter>.json``), ``prompts_per_request``, and ``lm_eval_args``: what else
            ``simple_evaluate`` takes (``gen_kwargs``, ``apply_chat_template``, ``log_samples``, seeds, ...), whose
            ``model_args`` (a dict, or lm-eval's ``key=value,...``) set each checkpoint's model's
            ``prefix_token_id``, ``max_length`` and ``max_gen_toks``, and ``tokenizer`` (the base model's own, read
            once for every checkpoint).
    """

    def __init__(self, settings: SweepSettings):
        own = sorted(set(settings.lm_eval_args or {}) & set(OWN_ARGUMENTS))
        if own:
            raise ValueError(
                f"lm_eval_args sets {', '.join(own)}, which the sweep sets itself: use lm_eval_tasks, "
                "lm_eval_limit and lm_eval_num_fewshot (the model is each checkpoint)"
            )
        self.settings, limit = settings, settings.lm_eval_limit
        self.limit = int(limit) if limit is not None and float(limit).is_integer() else limit
        self.tasks = tuple(settings.lm_eval_tasks or ())
        self.arguments: Dict[str, Any] = {"log_samples": False, **(settings.lm_eval_args or {})}
        self.model_args = _model_args(self.arguments.pop("model_args", None))
        #: The token cache's tokenizer (one cache serves every checkpoint), not each checkpoint model's setting: read
        #: once, now, so a bad path fails the sweep before any checkpoint.
        tokenizer = self.model_args.pop("tokenizer", None)
        self.tokenizer = None if tokenizer is None else local_tokenizer(tokenizer)
        self.tokens: Optional[TokenCache] = None
        self._task_manager: Any = None

    def __call__(self, checkpoint: EvaluatedCheckpoint) -> Dict[str, float]:
        """Run the tasks on the checkpoint; write lm-eval's results JSON; return its numbers as ``<task>/<key>``."""
        from lm_eval import simple_evaluate

        client, adapter = checkpoint.client, checkpoint.adapter
        if self.tokens is None:
            self.tokens = TokenCache(client, tokenizer=self.tokenizer)
        model = LoraSamplerLM(
            client=client,
            adapter=adapter,
            token_cache=self.tokens,
            prompts_per_request=self.settings.prompts_per_request,
            max_outage=checkpoint.max_outage,
            on_outage=checkpoint.on_outage,
            **self.model_args,
        )
        results = simple_evaluate(
            model=model,
            tasks=list(self.tasks),  # lm-eval reads a list, not a tuple (a fresh one: it is lm-eval's to change)
            limit=self.limit,
            num_fewshot=self.settings.lm_eval_num_fewshot,
            task_manager=self._tasks_index(),
            **self.arguments,
        )
        _write_results(os.path.join(self.settings.output_dir, RESULTS_FOLDER, f"{adapter.name}.json"), results)
        return metrics_of(results)

    def _tasks_index(self) -> Any:
        """lm-eval's task index, built once per sweep: of ``include_path`` alone when every task named is a task there
        (lm-eval's whole index reads its thousands of YAMLs: about 10 s of CPU), else lm-eval's with ``include_path``.

        A group or tag, or a task lm-eval ships, needs the whole index; a task of the folder resolves alike in both
        (the folder's YAMLs take precedence over lm-eval's in the whole index).
        """
        if self._task_manager is None:
            from lm_eval.tasks import TaskManager

            folder = self.settings.lm_eval_include_path
            if folder is not None:
                own = TaskManager(include_path=folder, include_defaults=False)
                if set(self.tasks) <= set(own.all_subtasks):
                    self._task_manager = own
                    return own
            self._task_manager = TaskManager(include_path=folder)
        return self._task_manager


def _model_args(given: Any) -> Dict[str, Any]:
    """``model_args`` of ``lm_eval_args``: a dict or lm-eval's ``key=value,...``; only ``MODEL_SETTINGS``."""
    if given is None:
        return {}
    if isinstance(given, str):
        from lm_eval.utils import simple_parse_args_string

        given = simple_parse_args_string(given)
    if not isinstance(given, Mapping):
        raise ValueError(f"lm_eval_args' model_args must be an object or key=value,..., got {given!r}")
    other = sorted(set(given) - set(MODEL_SETTINGS))
    if other:
        raise ValueError(
            f"lm_eval_args' model_args sets {', '.join(other)}: in a sweep the model is each checkpoint on the "
            "sweep's client (its flags set the engine, the concurrency and the timeout); model_args takes "
            + ", ".join(MODEL_SETTINGS)
        )
    return dict(given)


def metrics_of(results: Mapping[str, Any]) -> Dict[str, float]:
    """Every finite number lm-eval reports for a task (or group), as ``<task>/<key>`` with lm-eval's key."""
    metrics: Dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                    metrics[f"{task}/{key}"] = float(value)
    return metrics


def _write_results(path: str, results: Mapping[str, Any]) -> None:
    """Write lm-eval's results as its command line writes them (whole, or not at all: a kill leaves no half file)."""
    from lm_eval.utils import handle_non_serializable

    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    with replacing(path) as file:
        file.write(text.encode("utf-8"))
