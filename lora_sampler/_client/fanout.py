"""The thread-pool fan-out: the lazily started worker pool, the windowed iterators, and stopping them on Ctrl-C.

``FanOut`` runs a request function on its pool (``submit``) and streams results while keeping at most
``IN_FLIGHT_PER_WORKER * max_workers`` requests in flight (``imap`` in input order, ``imap_unordered`` as they
finish, ``collect`` into a list), so a generator of a million prompts never becomes a million futures. A
``KeyboardInterrupt`` while the caller waits on any of them cancels the requests of that fan-out: those not started
never start, those in flight have their connections shut (the engine aborts them), and nothing waits for them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
import weakref
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Generator,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Tuple,
    Union,
)

from lora_sampler._client.outage import OutageGate
from lora_sampler._transport.cancel import CancelScope
from lora_sampler.errors import RequestCancelledError, SamplingInterruptedError
from lora_sampler.types import SampleRequest, ScoreRequest, build_request

#: ``imap`` keeps at most this many requests per worker submitted ahead of the results it has yielded.
IN_FLIGHT_PER_WORKER = 2

RequestLike = Union[SampleRequest, ScoreRequest, Mapping[str, Any]]
Runner = Callable[[Any], Any]
Future = concurrent.futures.Future


class _Batch:
    """The requests of one fan-out (or of a client's ``submit`` calls): their cancel scope and unfinished futures."""

    def __init__(self) -> None:
        self.scope = CancelScope()
        self._futures: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, future: Future[Any]) -> None:
        with self._lock:
            self._futures.add(future)

    def cancel(self) -> None:
        """Cancel the futures not started and shut down the connections of those running; returns at once."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:  # first, so a worker freed by a shut connection does not start one of them
            future.cancel()
        self.scope.cancel()


class SampleFuture(Future):  # type: ignore[type-arg]
    """The future ``submit`` returns: Ctrl-C while waiting on it cancels every request submitted and not finished.

    Created as itself and settled by the worker that runs its request (``settle``), as an executor settles its own.

    Args:
        on_interrupt: Called when Ctrl-C arrives while a caller waits on this future.
    """

    def __init__(self, on_interrupt: Callable[[], None]):
        super().__init__()
        self._on_interrupt = on_interrupt

    def result(self, timeout: Optional[float] = None) -> Any:
        """As ``Future.result``; Ctrl-C while waiting cancels the submitted requests, then propagates."""
        try:
            return super().result(timeout)
        except KeyboardInterrupt:
            self._on_interrupt()
            raise

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """As ``Future.exception``; Ctrl-C while waiting cancels the submitted requests, then propagates."""
        try:
            return super().exception(timeout)
        except KeyboardInterrupt:
            self._on_interrupt()
            raise


def settle(future: Future[Any], run: Runner, request: Any) -> None:
    """Run ``run(request)`` for ``future`` (unless it was cancelled first) and set its result or exception."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        value = run(request)
    except BaseException as error:  # as the executor's own work items do: the caller sees it
        future.set_exception(error)
    else:
        future.set_result(value)


class FanOut:
    """A worker pool of ``max_workers`` threads, started on first use, and the iterators that feed it.

    Args:
        max_workers: Worker threads; each iterator keeps ``IN_FLIGHT_PER_WORKER`` times as many requests in flight.
    """

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pid = os.getpid()  # the process whose threads the executor's are
        self._lock = threading.Lock()
        self._closed = False
        self._batches: weakref.WeakSet[_Batch] = weakref.WeakSet()
        self._submits = self._new_batch()

    def close(self, *, wait: bool = True) -> None:
        """Refuse new work and stop the worker threads. Idempotent.

        Args:
            wait: Wait for submitted work (True), or cancel every request not finished and return at once (False).
        """
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            batches = [] if wait else list(self._batches)
        for batch in batches:
            batch.cancel()
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)

    def _new_batch(self) -> _Batch:
        batch = _Batch()
        with self._lock:
            self._batches.add(batch)
        return batch

    def _interrupt_submits(self) -> None:
        """Ctrl-C while waiting on a ``submit`` future: cancel every submitted request; later submits start afresh."""
        batch, self._submits = self._submits, self._new_batch()
        batch.cancel()

    def submit(self, run: Runner, request: Union[SampleRequest, ScoreRequest]) -> Future[Any]:
        """Run ``run(request)`` on the pool and return its future.

        Raises:
            RuntimeError: the client is closed.
        """
        batch = self._submits
        future = SampleFuture(self._interrupt_submits)
        batch.add(future)
        self._start(settle, future, functools.partial(batch.scope.run, run), request)
        return future

    def _submit(self, batch: _Batch, run: Runner, request: Any) -> Future[Any]:
        return self._start(batch.scope.run, run, request)

    def _start(self, function: Callable[..., Any], *arguments: Any) -> Future[Any]:
        """Run ``function(*arguments)`` on the pool (started on first use).

        Raises:
            RuntimeError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("this SamplerClient is closed; create a new one")
            if self._executor is None or self._pid != os.getpid():
                # In a forked child the parent's executor has no threads left: it would queue work forever.
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers, "lora_sampler")
                self._pid = os.getpid()
            return self._executor.submit(function, *arguments)

    def imap(
        self, requests: Iterable[RequestLike], run: Runner, *, return_exceptions: bool, gate: Optional[OutageGate]
    ) -> Iterator[Any]:
        """Yield the outcome of each request in input order, with a bounded window in flight (see ``SamplerClient``)."""
        return self._stream(requests, run, return_exceptions, gate, collections.deque())

    def collect(
        self,
        requests: Iterable[RequestLike],
        run: Runner,
        *,
        return_exceptions: bool,
        gate: Optional[OutageGate],
        on_outcome: Optional[Callable[[Any], None]] = None,
    ) -> List[Any]:
        """Return the outcomes in input order (``sample_many``); ``on_outcome`` sees each as it is taken.

        Raises:
            SamplingInterruptedError: Ctrl-C while waiting; ``results`` holds what had finished by then.
            Exception: the first failure (without ``return_exceptions``), its ``results`` set to the answers received.
        """
        results: List[Any] = []
        window: Deque[Future[Any]] = collections.deque()
        stream = self._stream(requests, run, return_exceptions, gate, window)
        try:
            for result in stream:
                results.append(result)
                if on_outcome is not None:
                    on_outcome(result)
        except KeyboardInterrupt as stop:
            stream.close()  # when the interrupt came between two results
            partial = results + [_finished(future) for future in window]
            message = (
                f"interrupted after {len(results)} of {len(partial)} requests submitted; the requests in flight were "
                "cancelled. The answers received are in this error's .results (in input order, None where none came)"
            )
            raise SamplingInterruptedError(message, results=partial) from stop
        except Exception as error:  # the first failure, raised: it carries every answer received
            keep_results(error, results + [_answered(future) for future in window])
            raise
        return results

    def _stream(
        self,
        requests: Iterable[RequestLike],
        run: Runner,
        return_exceptions: bool,
        gate: Optional[OutageGate],
        window: Deque[Future[Any]],
    ) -> Generator[Any, None, None]:
        batch = self._new_batch()
        run = _through(gate, run)
        limit = IN_FLIGHT_PER_WORKER * self.max_workers
        finished = False
        try:
            for item in requests:
                window.append(self._submit(batch, run, as_request(item)))
                while window and (len(window) >= limit or window[0].done()):
                    yield _take(window, return_exceptions)
            while window:
                yield _take(window, return_exceptions)
            finished = True
        finally:
            _end(batch, gate, window, finished)

    def imap_unordered(
        self, requests: Iterable[RequestLike], run: Runner, *, return_exceptions: bool, gate: Optional[OutageGate]
    ) -> Iterator[Tuple[int, Any]]:
        """Yield ``(index, outcome)`` pairs as requests finish, with a bounded window in flight."""
        batch = self._new_batch()
        run = _through(gate, run)
        pending: Dict[Future[Any], int] = {}
        limit = IN_FLIGHT_PER_WORKER * self.max_workers
        source = enumerate(requests)
        exhausted = finished = False
        try:
            while True:
                while not exhausted and len(pending) < limit:
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        break
                    pending[self._submit(batch, run, as_request(nxt[1]))] = nxt[0]
                if not pending:
                    finished = True
                    return
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), outcome(future, return_exceptions)
        finally:
            _end(batch, gate, pending, finished)


def _take(window: Deque[Future[Any]], return_exceptions: bool) -> Any:
    """Wait for the oldest request and take it out of the window (left in place while waiting, for a partial result)."""
    value = outcome(window[0], return_exceptions)
    window.popleft()
    return value


def _end(batch: _Batch, gate: Optional[OutageGate], unfinished: Iterable[Future[Any]], finished: bool) -> None:
    """Wind a fan-out down: cancel what never started, release held requests, and cancel the rest if it stopped early.

    A fan-out that stopped early (Ctrl-C, an error raised to the caller, or its iterator closed) has its requests in
    flight cancelled: their connections are shut, so the engine aborts them and nothing waits for them.
    """
    for future in list(unfinished):
        future.cancel()
    if gate is not None:
        gate.close()
    if not finished:
        batch.cancel()


def _finished(future: Future[Any]) -> Any:
    """The outcome of a finished request for a partial result (its output or its error); None if it did not finish."""
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    if isinstance(error, RequestCancelledError):
        return None
    return error if error is not None else future.result()


def _answered(future: Future[Any]) -> Any:
    """The output of a request that finished with one, else None (failed, cancelled or still running)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return None
    return future.result()


def keep_results(error: BaseException, results: List[Any]) -> None:
    """Set ``error.results`` to the answers received, unless the error cannot take an attribute."""
    with contextlib.suppress(AttributeError):  # an exception type with __slots__ keeps none
        error.results = results  # type: ignore[attr-defined]


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


def outcome(future: Future[Any], return_exceptions: bool) -> Any:
    """Return a finished request's output, or its exception with ``return_exceptions`` (else raise it)."""
    if not return_exceptions:
        return future.result()
    error = future.exception()
    return error if error is not None else future.result()
