"""The thread-pool fan-out: the lazily started worker pool and the two windowed iterators over many requests.

``FanOut`` runs a request function on its pool (``submit``) and streams results while keeping at most
``IN_FLIGHT_PER_WORKER * max_workers`` requests in flight (``imap`` in input order, ``imap_unordered`` as they
finish), so a generator of a million prompts never becomes a million futures. It knows nothing of HTTP.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

from lora_sampler._client.outage import OutageGate
from lora_sampler.types import SampleOutput, SampleRequest, ScoreRequest, build_request

#: ``imap`` keeps at most this many requests per worker submitted ahead of the results it has yielded.
IN_FLIGHT_PER_WORKER = 2

RequestLike = Union[SampleRequest, ScoreRequest, Mapping[str, Any]]
Runner = Callable[[Any], Any]
Future = concurrent.futures.Future


class FanOut:
    """A worker pool of ``max_workers`` threads, started on first use, and the iterators that feed it.

    Args:
        max_workers: Worker threads; each iterator keeps ``IN_FLIGHT_PER_WORKER`` times as many requests in flight.
    """

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Refuse new work, wait for submitted work, and stop the worker threads. Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def submit(self, run: Runner, request: Union[SampleRequest, ScoreRequest]) -> Future[Any]:
        """Run ``run(request)`` on the pool and return its future.

        Raises:
            RuntimeError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("this SamplerClient is closed; create a new one")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers, "lora_sampler")
            return self._executor.submit(run, request)

    def imap(
        self, requests: Iterable[RequestLike], run: Runner, *, return_exceptions: bool, gate: Optional[OutageGate]
    ) -> Iterator[Any]:
        """Yield the outcome of each request in input order, with a bounded window in flight (see ``SamplerClient``)."""
        run = _through(gate, run)
        window: Deque[Future[SampleOutput]] = collections.deque()
        limit = IN_FLIGHT_PER_WORKER * self.max_workers
        try:
            for item in requests:
                window.append(self.submit(run, as_request(item)))
                while window and (len(window) >= limit or window[0].done()):
                    yield outcome(window.popleft(), return_exceptions)
            while window:
                yield outcome(window.popleft(), return_exceptions)
        finally:
            for future in window:
                future.cancel()
            if gate is not None:
                gate.close()

    def imap_unordered(
        self, requests: Iterable[RequestLike], run: Runner, *, return_exceptions: bool, gate: Optional[OutageGate]
    ) -> Iterator[Tuple[int, Any]]:
        """Yield ``(index, outcome)`` pairs as requests finish, with a bounded window in flight."""
        run = _through(gate, run)
        pending: Dict[Future[SampleOutput], int] = {}
        limit = IN_FLIGHT_PER_WORKER * self.max_workers
        source = enumerate(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < limit:
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        break
                    pending[self.submit(run, as_request(nxt[1]))] = nxt[0]
                if not pending:
                    return
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), outcome(future, return_exceptions)
        finally:
            for future in pending:
                future.cancel()
            if gate is not None:
                gate.close()


def _through(gate: Optional[OutageGate], run: Runner) -> Runner:
    """Return ``run`` held through the outage gate of one fan-out (``run`` itself without a gate)."""
    if gate is None:
        return run
    return lambda request: gate.run(lambda: run(request))


def as_request(item: RequestLike) -> Union[SampleRequest, ScoreRequest]:
    """Return ``item`` as a request: a mapping of ``SampleRequest`` fields (``max_tokens`` and such too), or as is."""
    if isinstance(item, (SampleRequest, ScoreRequest)):
        return item
    if isinstance(item, Mapping):
        return build_request(**item)
    raise TypeError(f"requests must hold SampleRequest or ScoreRequest values or mappings, got {type(item).__name__}")


def outcome(future: Future[SampleOutput], return_exceptions: bool) -> Any:
    """Return a finished request's output, or its exception with ``return_exceptions`` (else raise it)."""
    if not return_exceptions:
        return future.result()
    error = future.exception()
    return error if error is not None else future.result()
