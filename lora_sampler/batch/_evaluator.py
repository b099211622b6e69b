"""An evaluator on one checkpoint: a callable taking a Tinker-compatible sampling client and returning metrics.

The sweep's third kind of work beside sampling and scoring lines: ``evaluator(sampling_client)`` (plain, or async
as tinker-cookbook's ``SamplingClientEvaluator`` is) returns ``dict[str, float]`` for the checkpoint. The sampling
client is ``lora_sampler.tinker.SamplingClient`` over the sweep's client, so its calls ride the retry table, the
race and the outage hold; ``lora_sampler.tinker`` (the ``[tinker]`` extra) is imported only here, when a sweep is
given an evaluator. Stopping cancels an async evaluator's task; a plain one runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import inspect
import math
import numbers
import threading
from typing import Any, Awaitable, Callable, Dict, Mapping, Optional, Union

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler.types import Adapter

#: What ``evaluator=`` takes: a callable of a sampling client returning metrics, or an awaitable of them.
Evaluator = Callable[[Any], Union[Mapping[str, float], Awaitable[Mapping[str, float]]]]
#: Metric values as the ledger keeps them: a float, or None for a value that is not finite (JSON has no NaN).
Metrics = Dict[str, Optional[float]]


class EvaluatorError(TypeError):
    """An evaluator that is not a callable, or whose answer is not a mapping of metric names to numbers."""


def checked_evaluator(evaluator: object) -> Evaluator:
    """Return ``evaluator`` once it is known to be callable (its answer is checked per checkpoint).

    Raises:
        EvaluatorError: it is not callable.
    """
    if not callable(evaluator):
        raise EvaluatorError(
            f"evaluator must be a callable taking a sampling client (e.g. a tinker-cookbook SamplingClientEvaluator), "
            f"got {type(evaluator).__name__}"
        )
    return evaluator


def load_factory(spec: str) -> Evaluator:
    """Import ``module:factory`` and call the factory with no argument; return the evaluator it makes.

    Raises:
        ValueError: ``spec`` is not ``module:attribute``.
        ImportError, AttributeError: the module or the factory cannot be found (the message names it).
        EvaluatorError: the factory is not callable, or does not return a callable.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"--evaluator takes module:factory (e.g. my_evals:make_evaluator), got {spec!r}")
    importlib.import_module(module_name)  # its own ImportError names the module
    try:  # the object reference of an entry point (``module:attr.path``), resolved as importlib.metadata does
        factory: Any = importlib.metadata.EntryPoint(spec, spec, "lora_sampler.evaluator").load()
    except AttributeError:
        raise AttributeError(f"module {module_name!r} has no {attribute!r} (from --evaluator {spec})") from None
    if not callable(factory):
        raise EvaluatorError(f"{spec} is a {type(factory).__name__}, not a factory to call")
    return checked_evaluator(factory())


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
        client: The sweep's client.
        adapter: The checkpoint's published adapter.
        max_outage: The sweep's outage hold (seconds), applied to each of the evaluator's requests.
        on_outage: Called with an ``OutageEvent`` while the engine is away.
    """

    def __init__(
        self,
        evaluator: Evaluator,
        client: SamplerClient,
        adapter: Adapter,
        *,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ):
        from lora_sampler.tinker import SamplingClient  # the [tinker] extra: only when there is an evaluator

        self._evaluator = evaluator
        self.sampling_client = SamplingClient(client, model_path=adapter, max_outage=max_outage, on_outage=on_outage)
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
        answer = self._evaluator(self.sampling_client)
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

    def stop(self) -> None:
        """Cancel an async evaluator's task (its requests not yet started are cancelled); a plain one runs on."""
        with self._lock:
            self._stopped = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended: nothing to cancel
                loop.call_soon_threadsafe(task.cancel)
