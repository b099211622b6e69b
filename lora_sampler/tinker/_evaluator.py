"""A Tinker sampling-client evaluator as a sweep's ``CheckpointEvaluator`` (the ``[tinker]`` extra).

tinker-cookbook's ``SamplingClientEvaluator`` (and any callable, plain or async, taking a Tinker sampling client and
returning ``dict[str, float]``) evaluates a checkpoint through a ``SamplingClient``; ``TinkerEvaluator`` builds that
client over the sweep's client and the checkpoint's adapter, so the evaluator's calls ride the retry table, the load
race and the sweep's outage hold.
"""

from __future__ import annotations

from typing import Any, Callable

from lora_sampler.batch._evaluator import CheckpointEvaluator, EvaluatedCheckpoint, EvaluatorError, MetricsAnswer
from lora_sampler.tinker._clients import SamplingClient


class TinkerEvaluator(CheckpointEvaluator):
    """Run ``evaluator(sampling_client)`` on each checkpoint of a sweep.

    Args:
        evaluator: A callable, plain or async, taking a ``SamplingClient`` of the checkpoint and returning
            ``dict[str, float]`` (e.g. a tinker-cookbook ``SamplingClientEvaluator``).

    Raises:
        EvaluatorError: ``evaluator`` is not callable.
    """

    def __init__(self, evaluator: Callable[[SamplingClient], Any]):
        if not callable(evaluator):
            raise EvaluatorError(
                "TinkerEvaluator takes a callable taking a sampling client (e.g. a tinker-cookbook "
                f"SamplingClientEvaluator), got {type(evaluator).__name__}"
            )
        self.evaluator = evaluator

    def __call__(self, checkpoint: EvaluatedCheckpoint) -> MetricsAnswer:
        """Hand the evaluator a Tinker sampling client of the checkpoint's adapter; return its answer."""
        client = SamplingClient(
            checkpoint.client,
            model_path=checkpoint.adapter,
            max_outage=checkpoint.max_outage,
            on_outage=checkpoint.on_outage,
        )
        answer: MetricsAnswer = self.evaluator(client)
        return answer

    def __repr__(self) -> str:
        return f"TinkerEvaluator({self.evaluator!r})"
