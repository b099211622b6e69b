"""The progress bar of ``SamplerClient.sample_many(progress=True)``, and the retry count it shows.

``tqdm.auto`` picks the bar: a notebook widget in Jupyter (one output, updated in place; it needs ipywidgets, the
``notebook`` extra), text on a terminal. It shows done/total, the rate, retries and failures, as the CLI's bar
does. tqdm is the optional ``cli`` extra, imported only when a bar is asked for.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

from lora_sampler.retry import RetryEvent


class RetryCounter:
    """A thread-safe count of retries, fed by a ``RetryPolicy.on_retry`` hook."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def hook(self, event: RetryEvent) -> None:
        """Count one retry (called from worker threads)."""
        with self._lock:
            self.value += 1


class ProgressBar:
    """One bar over the outcomes of a fan-out: done/total, rate, retries (since it started) and failures.

    Args:
        requests: The fan-out's requests; the total is their length when they have one (a list, a range).
        retries: Reads the client's retry count.
        total: The number of requests, for an iterable without a length (a generator); None: read it from
            ``requests`` when it has one.
    """

    def __init__(self, requests: Iterable[Any], retries: Callable[[], int], total: Optional[int] = None):
        if total is not None:
            self.check_total(total)
        try:
            from tqdm.auto import tqdm
        except ImportError:
            raise ImportError("progress=True needs tqdm: pip install 'lora_sampler[cli]'") from None
        if total is None:
            total = operator.length_hint(requests, -1)
        self._retries, self._first = retries, retries()
        self._failed = 0
        self._bar = tqdm(total=None if total is None or total < 0 else total, unit="req", dynamic_ncols=True)
        self._bar.set_postfix(retries=0, failed=0, refresh=False)

    @staticmethod
    def check_total(total: object) -> None:
        """Refuse a ``total=`` that is not a count.

        Raises:
            ValueError: ``total`` is not an int >= 0.
        """
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0 (the number of requests), got {total!r}")

    def update(self, outcome: Any) -> None:
        """Count one outcome (an exception counts as a failure)."""
        self._count(isinstance(outcome, BaseException))

    def count_row(self, kind: str) -> None:
        """Count one row of a batch job by its kind: ``"done"``, ``"failed"`` (rows resumed, ``"skipped"``, are not)."""
        if kind in ("done", "failed"):
            self._count(kind == "failed")

    def _count(self, failed: bool) -> None:
        self._failed += failed
        self._bar.set_postfix(retries=self._retries() - self._first, failed=self._failed, refresh=False)
        self._bar.update(1)

    def follow(self, outcomes: Iterator[Any], count: Callable[[Any], Any] = lambda outcome: outcome) -> Iterator[Any]:
        """Yield ``outcomes``, counting each (``count`` picks the outcome out of a yielded item); close at the end."""
        try:
            for item in outcomes:
                self.update(count(item))
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Draw the final state and release the bar."""
        self._bar.set_postfix(retries=self._retries() - self._first, failed=self._failed, refresh=False)
        self._bar.close()
