"""The sweep's evaluator seam: work of its own run on each checkpoint, returning metrics.

The sweep's third kind of work beside sampling and scoring lines. A ``CheckpointEvaluator`` is handed what it needs
to evaluate one checkpoint, an ``EvaluatedCheckpoint`` (the sweep's client and the checkpoint's published adapter,
with the sweep's outage hold), and returns ``dict[str, float]`` (or an awaitable of it, run in its own event loop).
Nothing here knows an evaluation library: ``lora_sampler.tinker.TinkerEvaluator`` wraps a Tinker sampling-client
evaluator (tinker-cookbook's), and others plug in the same way without tinker installed. Stopping cancels an async
evaluator's task; a plain one runs to its end.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Dict, Mapping, Optional, Union

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler.types import Adapter

#: What an evaluator returns: metrics by name, or an awaitable of them.
MetricsAnswer = Union[Mapping[str, float], Awaitable[Mapping[str, float]]]
#: Metric values as the ledger keeps them: a float, or None for a value that is not finite (JSON has no NaN).
Metrics = Dict[str, Optional[float]]


@dataclass(frozen=True)
class EvaluatedCheckpoint:
    """What an evaluator is handed for one checkpoint.

    Attributes:
        client: The sweep's client: every request through it rides the retry table, the load race and (with
            ``max_outage``) the outage hold.
        adapter: The checkpoint's adapter, published and warmed up.
        max_outage: The sweep's outage hold, in seconds, for the evaluator's own requests.
        on_outage: Called with an ``OutageEvent`` while the engine is away.
    """

    client: SamplerClient
    adapter: Adapter
    max_outage: float = 0.0
    on_outage: Optional[OutageHook] = None


class CheckpointEvaluator(abc.ABC):
    """An evaluation run on each checkpoint of a sweep (``sweep(..., evaluator=...)``, ``--evaluator``).

    Subclass it and return the checkpoint's metrics from ``__call__``; ``lora_sampler.tinker.TinkerEvaluator`` is one.
    """

    @abc.abstractmethod
    def __call__(self, checkpoint: EvaluatedCheckpoint) -> MetricsAnswer:
        """Evaluate one checkpoint; return ``dict[str, float]`` (or an awaitable of it)."""


class EvaluatorError(TypeError):
    """An evaluator that is not a callable, or whose answer is not a mapping of metric names to numbers."""


def checked_evaluator(evaluator: object) -> CheckpointEvaluator:
    """Return ``evaluator`` once it is known to be a ``CheckpointEvaluator`` (its answer is checked per checkpoint).

    Raises:
        EvaluatorError: it is not one; a plain callable is told how to wrap it.
    """
    if isinstance(evaluator, CheckpointEvaluator):
        return evaluator
    if callable(evaluator):
        raise EvaluatorError(
            "evaluator= takes a CheckpointEvaluator; wrap a callable taking a Tinker sampling client (e.g. a "
            "tinker-cookbook SamplingClientEvaluator) as lora_sampler.tinker.TinkerEvaluator(evaluator)"
        )
    raise EvaluatorError(
        f"evaluator must be a CheckpointEvaluator (or, wrapped in lora_sampler.tinker.TinkerEvaluator, a callable "
        f"taking a sampling client), got {type(evaluator).__name__}"
    )


def checked_metrics(answer: object) -> Metrics:
    """Return the metrics an evaluator answered, as floats (None for a value that is not finite).

    Raises:
        EvaluatorError: not a mapping of str to real numbers; the message names the first bad entry.
    """
    if not isinstance(answer, Mapping):
        raise EvaluatorError(f"the evaluator returned a {type(answer).__name__}; it must return dict[str, float]")
    metrics: Metrics = {}
    for name, value in answer.items():
        if not isinstance(name, str) or not name or not name.isprintable():
            raise EvaluatorError(
                f"the evaluator returned the metric name {name!r}; names must be non-empty printable str (they are "
                "column titles and plot labels)"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise EvaluatorError(
                f"the evaluator returned {name!r}: {value!r} ({type(value).__name__}); metric values must be numbers"
            )
        number = float(value)
        metrics[name] = number if math.isfinite(number) else None
    return metrics


class EvaluatorRun:
    """One evaluator call on one checkpoint, stoppable from another thread.

    Args:
        evaluator: The evaluator.
        checkpoint: What it is handed: the sweep's client, the checkpoint's adapter, the outage hold.
    """

    def __init__(self, evaluator: CheckpointEvaluator, checkpoint: EvaluatedCheckpoint):
        self._evaluator, self.checkpoint = evaluator, checkpoint
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Future[Any]] = None
        self._stopped = False

    def run(self) -> Metrics:
        """Call the evaluator (an async one in this thread's own event loop) and check its metrics.

        Raises:
            asyncio.CancelledError: ``stop`` cancelled it.
            Exception: whatever the evaluator raised.
        """
        answer = self._evaluator(self.checkpoint)
        if inspect.isawaitable(answer):
            answer = asyncio.run(self._until_stopped(answer))
        return checked_metrics(answer)

    async def _until_stopped(self, awaitable: Awaitable[Any]) -> Any:
        task = asyncio.ensure_future(awaitable)
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), task
            if self._stopped:
                task.cancel()
        return await task

    def stop(self, grace: float = 0.0) -> None:
        """Cancel an async evaluator's task (its requests not yet started are cancelled); a plain one runs on.

        Args:
            grace: Ignored: the task is cancelled at once (``BatchJob.stop``'s signature, so a sweep stops either).
        """
        with self._lock:
            self._stopped = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended: nothing to cancel
                loop.call_soon_threadsafe(task.cancel)
