"""``TinkerFuture``: a ``concurrent.futures.Future`` that is also Tinker's ``APIFuture`` (awaitable).

Tinker's ``sample`` and ``compute_logprobs`` return a future to ``.result()`` or ``await``; code written before
tinker 0.38 also treats it as a ``concurrent.futures.Future`` (``wait``, ``as_completed``, callbacks). This one is
both: it follows the client's own future (the request running on the client's thread pool through the retry
table) and holds the answer converted to Tinker's type.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Any, Callable, Generator, Generic, Optional, TypeVar

import tinker

T = TypeVar("T")


class TinkerFuture(concurrent.futures.Future, tinker.APIFuture, Generic[T]):  # type: ignore[type-arg]
    """The future of one Tinker call: ``.result()``, ``await``, ``result_async()``, ``future()``, or as a Future.

    Ctrl-C while ``.result()`` waits cancels the client's submitted requests (their connections are shut, so the
    engine aborts them), as ``SamplerClient.submit`` futures do; ``cancel()`` cancels the request if it has not
    started.

    Args:
        inner: The client's future of the request.
        convert: Turns the client's answer into Tinker's (runs once, in the thread that finished ``inner``).
    """

    def __init__(self, inner: concurrent.futures.Future[Any], convert: Callable[[Any], T]):
        super().__init__()
        self._inner = inner
        self._convert = convert
        inner.add_done_callback(self._settle)

    def _settle(self, inner: concurrent.futures.Future[Any]) -> None:
        """Copy the finished request's outcome here, converted; a failed conversion is this future's exception."""
        if inner.cancelled():
            concurrent.futures.Future.cancel(self)
            self.set_running_or_notify_cancel()
            return
        error = inner.exception()
        if error is not None:
            self.set_exception(error)
            return
        try:
            value = self._convert(inner.result())
        except BaseException as exc:  # a malformed answer: the caller sees it, not the worker thread
            self.set_exception(exc)
        else:
            self.set_result(value)

    def _wait_inner(self, timeout: Optional[float]) -> Optional[float]:
        """Wait on the client's future (whose wait turns Ctrl-C into cancelling the submitted requests).

        Returns:
            What is left of ``timeout`` for the conversion to land here (None: no bound).
        """
        started = time.monotonic()
        with contextlib.suppress(concurrent.futures.CancelledError):
            self._inner.exception(timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))

    def result(self, timeout: Optional[float] = None) -> T:
        """The answer in Tinker's type; raises the request's error, or ``TimeoutError`` after ``timeout`` seconds."""
        return super().result(self._wait_inner(timeout))  # type: ignore[no-any-return]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The request's error, or None; as ``Future.exception``."""
        return super().exception(self._wait_inner(timeout))

    def cancel(self) -> bool:
        """Cancel the request if it has not started (True); a request in flight runs on (False)."""
        return self._inner.cancel()  # its callback cancels this future too

    async def result_async(self, timeout: Optional[float] = None) -> T:
        """Await the answer (``TimeoutError`` after ``timeout`` seconds; None waits as long as the request runs)."""
        waiting: asyncio.Future[T] = asyncio.wrap_future(self)
        if timeout is None:
            return await waiting  # type: ignore[no-any-return]
        return await asyncio.wait_for(waiting, timeout)  # type: ignore[no-any-return]

    def future(self) -> concurrent.futures.Future[T]:
        """This future itself (it is a ``concurrent.futures.Future``)."""
        return self

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()
