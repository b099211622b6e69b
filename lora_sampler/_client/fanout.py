"""The thread-pool fan-out: the lazily started worker pool, the windowed iterators, batching, and stopping on Ctrl-C.

``FanOut`` runs a batch function on its pool, each request in a batch of one unless batched (``submit``), and streams
results while keeping a bounded number of
prompts in flight (``stream``: in input order, or as they finish; ``collect`` into a list), so a
generator of a million prompts never becomes a million futures.

With ``Batching``, requests that can share one ``/v1/completions`` (one model and the same settings, ``batch_key``)
are gathered into batches of at most ``prompts_per_request`` prompts: the first prompt of a key opens a batch and
queues it on the pool; later prompts of that key join it until it is full or a worker takes it. So a batch goes as
soon as a worker is free for it, holding what arrived meanwhile: nothing waits for a batch to fill. Every prompt
keeps its own future, so order, errors, progress and partial results stay per prompt, and the read-ahead is counted
in prompts: ``IN_FLIGHT_PER_WORKER * max_workers`` times the batch size.

A ``KeyboardInterrupt`` while the caller waits on any of them cancels the requests of that fan-out: those not
started never start, those in flight have their connections shut (the engine aborts them), and nothing waits for
them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import json
import os
import queue
import threading
import weakref
from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    Hashable,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
    cast,
)

from lora_sampler._client.outage import OutageGate
from lora_sampler._client.progress import ProgressBar
from lora_sampler._defaults import (
    DEFAULT_SAMPLING_PROMPTS_PER_REQUEST,
    DEFAULT_SCORING_PROMPTS_PER_REQUEST,
    GENERATED_TOKENS_PER_REQUEST,
    MAX_PROMPTS_PER_REQUEST,
)
from lora_sampler._transport.connections import CancelScope
from lora_sampler.errors import LoraSamplerError, RequestCancelledError, SamplingInterruptedError
from lora_sampler.types import DEFAULT_SAMPLING_PARAMS, SampleRequest, ScoreRequest, build_request

#: ``imap`` keeps at most this many requests per worker submitted ahead of the results it has yielded.
IN_FLIGHT_PER_WORKER = 2

RequestLike = Union[SampleRequest, ScoreRequest, Mapping[str, Any]]
Request = Union[SampleRequest, ScoreRequest]
#: What a fan-out runs: the requests of one batch (one, or several gathered by ``Batching``), and per request its
#: outcome (an output or its own error); raises a failure the whole batch shares.
BatchRunner = Callable[[Sequence[Any]], Sequence[Any]]
Future = concurrent.futures.Future


class SampleFuture(Future):  # type: ignore[type-arg]
    """The future ``submit`` returns: Ctrl-C while waiting on it cancels every request submitted and not finished.

    Created as itself and settled by the worker that runs its request, as an executor settles its own.

    Args:
        on_interrupt: Called when Ctrl-C arrives while a caller waits on this future.
    """

    def __init__(self, on_interrupt: Callable[[], None]):
        super().__init__()
        self._on_interrupt = on_interrupt

    def result(self, timeout: Optional[float] = None) -> Any:
        """As ``Future.result``; Ctrl-C while waiting cancels the submitted requests, then propagates."""
        return self._interruptible(super().result, timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """As ``Future.exception``; Ctrl-C while waiting cancels the submitted requests, then propagates."""
        return cast(Optional[BaseException], self._interruptible(super().exception, timeout))

    def _interruptible(self, wait: Callable[[Optional[float]], Any], timeout: Optional[float]) -> Any:
        try:
            return wait(timeout)
        except KeyboardInterrupt:
            self._on_interrupt()
            raise


def checked_prompts_per_request(value: object) -> Optional[int]:
    """Return ``prompts_per_request`` if valid: None (the measured defaults) or an int in 1..``MAX``.

    Raises:
        ValueError: anything else; the message says what is accepted.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROMPTS_PER_REQUEST:
        raise ValueError(
            f"prompts_per_request must be None (the measured defaults), 1 (one prompt per request) or an int up to "
            f"{MAX_PROMPTS_PER_REQUEST}, got {value!r}"
        )
    return value


def default_prompts_per_request(request: Request) -> int:
    """The measured default batch size for ``request``'s kind of work (see ``_defaults``).

    Scoring: ``DEFAULT_SCORING_PROMPTS_PER_REQUEST``. Sampling: ``DEFAULT_SAMPLING_PROMPTS_PER_REQUEST`` for short
    generations, fewer as each prompt may generate more (at most about ``GENERATED_TOKENS_PER_REQUEST`` tokens per
    request, so one request's answer never waits on many long generations), down to 1; 1 for ``max_tokens=None``.
    """
    if isinstance(request, ScoreRequest):
        return DEFAULT_SCORING_PROMPTS_PER_REQUEST
    max_tokens = (request.sampling_params or DEFAULT_SAMPLING_PARAMS).max_tokens
    if max_tokens is None:  # up to the context: as long as generations get
        return 1
    generated = max_tokens * request.num_samples
    return max(1, min(DEFAULT_SAMPLING_PROMPTS_PER_REQUEST, GENERATED_TOKENS_PER_REQUEST // generated))


def batch_key(request: Request) -> Optional[Hashable]:
    """Return what requests must share to go as one ``/v1/completions`` (everything but the prompt), or None.

    None means "always alone": chat requests (the chat endpoint takes one conversation), and requests whose extra
    body fields cannot be compared.
    """
    if isinstance(request, ScoreRequest):
        as_text = request.completion is None and isinstance(request.prompt, str)  # else scored as token ids
        return (ScoreRequest, request.adapter, request.base_model, request.session_id, as_text)
    if request.messages is not None:
        return None
    extra: Optional[str] = None
    if request.extra_body:
        try:
            extra = json.dumps(request.extra_body, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
    return (
        SampleRequest,
        request.adapter,
        request.base_model,
        request.num_samples,
        request.sampling_params,
        request.prompt_logprobs,
        request.topk_prompt_logprobs,
        request.session_id,
        request.timeout,
        extra,
        isinstance(request.prompt, str),  # vLLM takes a list of texts or of token-id lists, not both
    )


class Batching:
    """How one fan-out puts prompts together.

    Args:
        prompts_per_request: At most this many prompts per request; None: the measured default of each request's
            kind (``default_prompts_per_request``).
    """

    def __init__(self, prompts_per_request: Optional[int]):
        self.prompts_per_request = checked_prompts_per_request(prompts_per_request)

    @property
    def largest(self) -> int:
        """The most prompts one of this fan-out's requests may carry (it sizes the read-ahead)."""
        if self.prompts_per_request is not None:
            return self.prompts_per_request
        return max(DEFAULT_SCORING_PROMPTS_PER_REQUEST, DEFAULT_SAMPLING_PROMPTS_PER_REQUEST)

    def size_for(self, request: Request) -> int:
        """The most prompts the batch ``request`` opens may hold."""
        if self.prompts_per_request is not None:
            return self.prompts_per_request
        return default_prompts_per_request(request)


class _Group:
    """The prompts of one batch: their requests and futures, gathered until a worker takes them or it is full."""

    __slots__ = ("__weakref__", "futures", "key", "requests", "size")

    def __init__(self, key: Optional[Hashable], size: int, request: Request, future: Future[Any]):
        self.key, self.size = key, size
        self.requests: List[Request] = [request]
        self.futures: List[Future[Any]] = [future]

    def cancel(self) -> bool:
        """Cancel the prompts not started (a batch starts all its prompts at once)."""
        for future in self.futures:
            future.cancel()
        return True


class _Gatherer:
    """Sends the requests of one fan-out (or one ``submit``) on the pool as batches, each run when a worker is free:
    a batch of one, or with ``Batching`` those gathered until a worker takes them.

    Holds no reference to the fan-out's caller: only the pool's start function, the run function and the gate. Its
    lock is its cancel scope's: one lock a fan-out.
    """

    def __init__(
        self,
        start: Callable[..., Future[Any]],
        work: CancelScope,
        run: BatchRunner,
        gate: Optional[OutageGate],
        batching: Optional[Batching] = None,
    ):
        self._start, self._work, self._run, self._gate = start, work, run, gate
        self._batching = None if batching is None or batching.prompts_per_request == 1 else batching  # 1: alone
        self._open: Dict[Hashable, _Group] = {}  # the batch of each key still taking prompts
        self._lock = work.lock

    def add(self, request: Request, future: Optional[Future[Any]] = None) -> Future[Any]:
        """Put ``request`` into its key's open batch, or open one (queued on the pool); return its future (``future``,
        a ``submit``'s, if given), which the batch's task settles."""
        key = None if self._batching is None else batch_key(request)
        future = Future() if future is None else future
        try:
            if key is not None and self._joined(key, request, future):
                return future
        except TypeError:  # a part of the key cannot be hashed (an unusual adapter value): it goes alone
            key = None
        size = 1 if key is None else cast(Batching, self._batching).size_for(request)
        group = _Group(key, size, request, future)
        if size > 1:
            with self._lock:
                self._open[key] = group
        self._work.add(group)
        try:
            self._start(self._take, group)
        except BaseException:
            self._close(group)
            raise
        return future

    def _close(self, group: _Group) -> None:
        """Take ``group`` out of the open batches: no prompt joins it any more. A one-prompt group (a request that
        goes alone, every ``submit``) was never open: it takes no lock."""
        if group.size == 1:
            return
        with self._lock:
            if self._open.get(group.key) is group:
                del self._open[group.key]

    def _joined(self, key: Hashable, request: Request, future: Future[Any]) -> bool:
        """Put ``request`` into its key's open batch (closed once full); False when the key has none open."""
        with self._lock:
            group = self._open.get(key)
            if group is None:
                return False
            group.requests.append(request)
            group.futures.append(future)
            if len(group.futures) >= group.size:
                del self._open[key]  # full: the next prompt of this key opens another
            return True

    def _take(self, group: _Group) -> None:
        """Close ``group`` to new prompts, run the prompts not cancelled as one request, and settle their futures."""
        self._close(group)
        pairs = zip(group.requests, group.futures)
        live = [(request, future) for request, future in pairs if future.set_running_or_notify_cancel()]
        if not live:
            return
        requests = [request for request, _ in live]
        try:
            outcomes = self._work.run(self._send, requests)
            if len(outcomes) != len(requests):  # a bug, never the engine: say so on every prompt
                raise RuntimeError(f"a batch of {len(requests)} requests gave {len(outcomes)} outcomes")
        except BaseException as error:  # the whole request failed (as an executor's work item: the caller sees it)
            outcomes = [error] * len(live)
        for (_, future), outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _send(self, requests: List[Request]) -> Sequence[Any]:
        """Run one batch (held through outages by the gate as one request)."""
        run = self._run
        return run(requests) if self._gate is None else self._gate.run(lambda: run(requests))


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
        self._works: weakref.WeakSet[CancelScope] = weakref.WeakSet()
        self._submits = self._new_work()

    def close(self, *, wait: bool = True) -> None:
        """Refuse new work and stop the worker threads. Idempotent.

        Args:
            wait: Wait for submitted work (True), or cancel every request not finished and return at once (False).
        """
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            works = [] if wait else list(self._works)
        for work in works:
            work.cancel()
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)

    def _new_work(self) -> CancelScope:
        work = CancelScope()
        with self._lock:
            self._works.add(work)
        return work

    def _interrupt_submits(self) -> None:
        """Ctrl-C while waiting on a ``submit`` future: cancel every submitted request; later submits start afresh."""
        work, self._submits = self._submits, self._new_work()
        work.cancel()

    def submit(self, run: BatchRunner, request: Request, gate: Optional[OutageGate] = None) -> Future[Any]:
        """Run ``run([request])`` on the pool, held through outages by its own ``gate`` if any; return its future.

        Raises:
            RuntimeError: the client is closed.
        """
        future = SampleFuture(self._interrupt_submits)
        if gate is not None:  # the request's own gate: once it ends, no thread is left waiting on it
            future.add_done_callback(lambda _: gate.close())
        return _Gatherer(self._start, self._submits, run, gate).add(request, future)

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
            # The worker runs in a copy of the submitting context: a mixing() block's requests stay its own.
            return self._executor.submit(contextvars.copy_context().run, function, *arguments)

    def collect(self, requests: Iterable[RequestLike], *, return_exceptions: bool, **fan_out: Any) -> List[Any]:
        """Return the outcomes in input order (``sample_many``): ``stream`` with ``fan_out``, its other keywords.

        Raises:
            SamplingInterruptedError: Ctrl-C while waiting; ``results`` holds what had finished by then.
            Exception: the first failure (without ``return_exceptions``), its ``results`` set to the answers received.
        """
        results: List[Any] = []
        window: Dict[Future[Any], int] = {}
        stream = self.stream(requests, return_exceptions=return_exceptions, window=window, **fan_out)
        try:
            for result in stream:
                results.append(result)
        except KeyboardInterrupt as stop:
            stream.close()  # when the interrupt came between two results
            partial = results + [_finished(future) for future in window]
            held = sum(result is not None for result in partial)
            message = (
                f"interrupted with {held} of the {len(partial)} requests submitted finished; the requests in flight "
                "were cancelled. Their outcomes are in this error's .results (in input order, None where none came)"
            )
            raise SamplingInterruptedError(message, results=partial) from stop
        except Exception as error:  # the first failure, raised: it carries every answer received
            kept = results + [_finished(future, errors=False) for future in window]
            with contextlib.suppress(AttributeError):  # an exception type with __slots__ keeps no results
                error.results = kept  # type: ignore[attr-defined]
            if isinstance(error, LoraSamplerError) and window:  # the oldest request's failure, not the iterable's
                _say_where(error, len(results), kept)
                # Its message says it all: the worker thread's frames (the transport's) are no help to the caller.
                raise error.with_traceback(None) from error.__cause__
            raise
        return results

    def stream(
        self,
        requests: Iterable[Any],
        run: BatchRunner,
        *,
        return_exceptions: bool,
        gate: Optional[OutageGate],
        batching: Optional[Batching] = None,
        bar: Optional[ProgressBar] = None,
        checked: Optional[Callable[[Any], Any]] = None,
        window: Optional[Dict[Future[Any], int]] = None,
        ordered: bool = True,
    ) -> Generator[Any, None, None]:
        """Send ``requests`` with a bounded window in flight; yield each outcome in input order (``imap``), or (not
        ``ordered``: ``imap_unordered``) each ``(index, outcome)`` as it finishes.

        Each outcome taken is counted on ``bar`` (if any), which is closed when the stream ends. ``checked`` turns an
        item into a request of ``run``'s batches (None: ``as_request``); an item it refuses (``TypeError``,
        ``ValueError``) is its slot's error, never sent. ``window`` holds each request in flight and its input index,
        in input order: a caller that stops the stream early reads the partial results from it.
        """
        work = self._new_work()
        send = _Gatherer(self._start, work, run, gate, batching).add
        limit = IN_FLIGHT_PER_WORKER * self.max_workers * (1 if batching is None else batching.largest)
        source = _Source(requests)
        window = {} if window is None else window
        done: Optional[queue.SimpleQueue[Future[Any]]] = None if ordered else queue.SimpleQueue()  # as they finish
        finished = False
        try:
            for index, item in enumerate(source):
                future = _sent(send, item, checked or as_request)
                window[future] = index
                if done is not None:
                    future.add_done_callback(done.put)
                while window and (len(window) >= limit or _ready(window, done)):
                    yield _take(window, done, return_exceptions, bar)
            while window:
                yield _take(window, done, return_exceptions, bar)
            finished = True
        finally:
            _end(work, gate, bar, finished)
        source.check()


def _ready(window: Dict[Future[Any], int], done: Optional[queue.SimpleQueue[Future[Any]]]) -> bool:
    """Tell whether a request can be taken out of the window without waiting (see ``_take``)."""
    return next(iter(window)).done() if done is None else not done.empty()


def _take(
    window: Dict[Future[Any], int],
    done: Optional[queue.SimpleQueue[Future[Any]]],
    return_exceptions: bool,
    bar: Optional[ProgressBar],
) -> Any:
    """Wait for the oldest request, or (with ``done``) the next to finish, and take it out of the window (left in place
    while waiting, for a partial result), counted on ``bar``: its outcome, or with ``done`` ``(index, outcome)``."""
    future = next(iter(window)) if done is None else done.get()
    value = outcome(future, return_exceptions)
    if bar is not None:
        bar.update(value)
    index = window.pop(future)
    return value if done is None else (index, value)


def _end(work: CancelScope, gate: Optional[OutageGate], bar: Optional[ProgressBar], finished: bool) -> None:
    """Wind a fan-out down: if it stopped early, cancel what it has not finished; release its held requests; close
    its bar.

    A fan-out that stopped early (Ctrl-C, an error raised to the caller, or its iterator closed) has its scope
    cancelled: its batches not started are cancelled, a request that went alone and was not started is refused by the
    scope when a worker takes it (nothing is sent), and those in flight are cut: their connections are shut, so the
    engine aborts them and nothing waits for them.
    """
    if not finished:
        work.cancel()
    if gate is not None:
        gate.close()
    if bar is not None:
        bar.close()


def _finished(future: Future[Any], errors: bool = True) -> Any:
    """A finished request's outcome for a partial result: its output, or with ``errors`` its error (not a
    cancellation); None for a request that did not finish (cancelled, still running) or, without ``errors``, failed."""
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    if error is None:
        return future.result()
    return error if errors and not isinstance(error, RequestCancelledError) else None


def _say_where(error: LoraSamplerError, index: int, kept: List[Any]) -> None:
    """Name the input a raised failure belongs to and the answers kept on ``.results``."""
    held = sum(result is not None for result in kept)
    error.message += (
        f" [input {index} of sample_many; {held} answers received so far are in this error's .results, one slot per "
        "request submitted in input order, None where none came; return_exceptions=True keeps going past failures]"
    )
    error.args = (error.message,)


class _Source:
    """The caller's requests as one fan-out pulls them, counted; a failure of their iterator is held, not raised.

    So the requests pulled before it run to their end and keep their answers (``check`` raises it afterwards).
    """

    def __init__(self, requests: Iterable[RequestLike]):
        self._items = iter(requests)
        self.pulled = 0
        self.error: Optional[Exception] = None

    def __iter__(self) -> Iterator[RequestLike]:
        while True:
            try:
                item = next(self._items)
            except StopIteration:
                return
            except Exception as error:  # the caller's generator failed (Ctrl-C is no Exception: it stops at once)
                self.error = error
                return
            self.pulled += 1
            yield item

    def check(self) -> None:
        """Raise the iterator's failure, once every request pulled before it has its outcome.

        Raises:
            LoraSamplerError: the iterator raised; the error names it and how many requests ran (its cause is it).
        """
        if self.error is None:
            return
        raise LoraSamplerError(
            f"the requests iterable raised {type(self.error).__name__}: {self.error} after {self.pulled} requests; "
            f"those {self.pulled} ran to their end and were kept (sample_many: in this error's .results, one slot "
            "each in input order; imap: yielded before this error)"
        ) from self.error


def _sent(send: Callable[[Request], Future[Any]], item: RequestLike, checked: Callable[[Any], Any]) -> Future[Any]:
    """Send one item of a fan-out; an invalid item is not sent: its future holds its error (its slot's outcome)."""
    try:
        request = checked(item)
    except (TypeError, ValueError) as error:
        refused: Future[Any] = Future()
        refused.set_exception(error)
        return refused
    return send(request)


def as_request(item: RequestLike) -> Request:
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
