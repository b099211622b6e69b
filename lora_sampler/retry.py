"""The retry contract (docs/guides/retries.md): the policy value, the table, the wait schedule and the backoff glue.

This is the only module that imports ``backoff``. It decides *whether* and *when* to retry; what happens before
a wait (the proactive adapter load) is handed in by the client. It sends no requests itself.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    cast,
)

if TYPE_CHECKING:  # annotations only: typing.TypeGuard is Python 3.10+
    from typing import TypeGuard

import backoff
import urllib3

from lora_sampler._testmode import is_testing as is_testing  # re-exported: its public home was here
from lora_sampler._testmode import set_testing as set_testing
from lora_sampler.errors import (
    AdapterNotReadyError,
    EngineConnectionError,
    EngineError,
    EngineStatusError,
    EngineTimeoutError,
    ModelNotFoundError,
    short_cause,
)
from lora_sampler.types import check_count, checked_seconds

logger = logging.getLogger(__name__)

#: Attempts in all, the first included.
DEFAULT_MAX_ATTEMPTS = 6
#: The first wait, in seconds; each later one doubles.
DEFAULT_BASE_DELAY = 0.125
#: No single wait is longer than this, in seconds.
DEFAULT_MAX_DELAY = 2.0
#: Timeout of the proactive ``POST /v1/load_lora_adapter``, in seconds.
DEFAULT_LOAD_TIMEOUT = 10.0
#: Statuses an engine uses to say "busy, try later"; retried only when the policy opts in.
OVERLOAD_STATUSES = (429, 503)


@dataclass(frozen=True)
class RetryEvent:
    """What a retry hook is told. Holds no prompt and no API key.

    Attributes:
        attempt: The attempt that just failed (1-based).
        max_attempts: Attempts allowed in all.
        wait: Seconds until the next attempt (0 for a give-up event).
        elapsed: Seconds since the first attempt started (monotonic clock).
        cause: The error of the failed attempt.
        model: The requested model or adapter name.
        adapter: Whether it was a LoRA adapter request.
    """

    attempt: int
    max_attempts: int
    wait: float
    elapsed: float
    cause: EngineError
    model: str
    adapter: bool


class RetryHook(Protocol):
    """A callable that receives one ``RetryEvent``."""

    def __call__(self, event: RetryEvent) -> None: ...  # pragma: no cover


#: One hook or several; ``RetryPolicy`` stores them as a tuple.
Hooks = Union[Callable[[RetryEvent], None], Sequence[Callable[[RetryEvent], None]]]


def _as_hooks(value: Any, field_name: str) -> Tuple[Callable[[RetryEvent], None], ...]:
    if value is None:
        return ()
    hooks = (value,) if callable(value) else tuple(value)
    for hook in hooks:
        if not callable(hook):
            raise TypeError(f"{field_name} must be a callable or an iterable of callables, got {hook!r}")
    return hooks


@dataclass(frozen=True)
class RetryPolicy:
    """How lora_sampler retries a failed completion; one immutable value shared by every thread.

    Change it with ``dataclasses.replace(policy, max_attempts=3)``.

    Args:
        max_attempts: Attempts in all, >= 1 (1 turns retries off).
        base_delay: First wait in seconds, finite; waits double from here.
        max_delay: Cap on a single wait in seconds.
        load_timeout: Timeout of the proactive adapter load in seconds, finite and > 0.
        retry_overloaded: Also retry 429 and 503 within the same bounds, honouring ``Retry-After`` (capped at
            ``max_delay``). Off by default: the seed rules raise them at once so real overload is not masked.
        on_retry: Hook(s) called with a ``RetryEvent`` before each wait.
        on_giveup: Hook(s) called with a ``RetryEvent`` when retries ran out (not for errors never retried).
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    base_delay: float = DEFAULT_BASE_DELAY
    max_delay: float = DEFAULT_MAX_DELAY
    load_timeout: float = DEFAULT_LOAD_TIMEOUT
    retry_overloaded: bool = False
    on_retry: Hooks = field(default=())
    on_giveup: Hooks = field(default=())

    def __post_init__(self) -> None:
        check_count("max_attempts", self.max_attempts, 1)
        for name in ("base_delay", "max_delay", "load_timeout"):  # kept as the seconds checked: 10**400 is inf
            object.__setattr__(self, name, checked_seconds(getattr(self, name), name))
        if self.base_delay == math.inf:  # the first wait: jittered, an infinite one is NaN
            raise ValueError("base_delay must be a finite number of seconds >= 0 (the first wait), got inf")
        if not 0 < self.load_timeout < math.inf:  # the load request's timeout, as a request's own must be
            raise ValueError(
                f"load_timeout must be a finite number of seconds > 0 (a timeout), got {self.load_timeout}"
            )
        if self.max_delay < self.base_delay:
            raise ValueError(f"max_delay ({self.max_delay}) must be >= base_delay ({self.base_delay})")
        object.__setattr__(self, "on_retry", _as_hooks(self.on_retry, "on_retry"))
        object.__setattr__(self, "on_giveup", _as_hooks(self.on_giveup, "on_giveup"))

    def should_retry(self, error: BaseException) -> bool:
        """Apply the retry table to one failed attempt, one row a line; the error alone decides.

        The rows' errors are classified once, by the transport (``EngineStatusError.from_response``).
        """
        if is_transport_failure(error):
            return True  # transport error (refused, reset, DNS, timeout): retry; adapters get a load first
        if is_adapter_race(error):
            return error.adapter  # 404, 400 "does not exist"/"not found"/"could not be loaded"/JSON: adapters only
        if is_overloaded(error):
            return self.retry_overloaded  # 429/503: raised at once unless the policy opts in
        return False  # any other 400, 401/403/422, other 4xx, 5xx, and anything not from the engine: raise

    def delays(self) -> Iterator[float]:
        """Yield the nominal waits: ``base_delay`` doubling each time, capped at ``max_delay``, forever."""
        delay = self.base_delay
        while True:
            yield min(delay, self.max_delay)
            delay *= 2

    def wait_for(self, nominal: float, error: BaseException) -> float:
        """Return the actual wait before the next attempt: the jittered nominal wait, or ``Retry-After``."""
        wait = jitter(nominal)
        if self.retry_overloaded and isinstance(error, EngineStatusError) and error.status in OVERLOAD_STATUSES:
            retry_after = _retry_after_seconds(error)
            if retry_after is not None and not is_testing():
                wait = max(wait, min(retry_after, self.max_delay))
        return wait


DEFAULT_RETRY_POLICY = RetryPolicy()


def is_transport_failure(error: BaseException) -> bool:
    """Tell whether the request got no answer: refused, reset, DNS, timeout (the table's first row; an outage sign)."""
    return isinstance(error, (EngineConnectionError, EngineTimeoutError))


def is_adapter_race(error: BaseException) -> TypeGuard[EngineStatusError]:
    """Tell whether the engine does not serve the name (yet): the adapter-load race for an adapter, else a typo."""
    return isinstance(error, (ModelNotFoundError, AdapterNotReadyError))


def is_overloaded(error: BaseException) -> bool:
    """Tell whether the engine said "busy, try later" (429 or 503)."""
    return isinstance(error, EngineStatusError) and error.status in OVERLOAD_STATUSES


def jitter(wait: float) -> float:
    """Return a wait drawn uniformly from ``[wait / 2, wait]`` (0 in testing mode).

    Threads that failed together then retry at different moments, and the total stays between half and all of
    the nominal schedule.
    """
    if is_testing():
        return 0.0
    return random.uniform(wait / 2, wait)


_RETRY_AFTER_PARSER = urllib3.Retry(0)


def _retry_after_seconds(error: EngineStatusError) -> Optional[float]:
    """Read ``Retry-After`` (seconds or an HTTP date) with urllib3's own parser; None when absent or invalid."""
    response = error.response
    value = response.headers.get("Retry-After") if response is not None else None
    if not value:
        return None
    try:
        return float(_RETRY_AFTER_PARSER.parse_retry_after(value))
    except urllib3.exceptions.InvalidHeader:
        return None


class RetryCall(Protocol):
    """What the retry glue needs to know about one sample call."""

    model: str
    is_adapter: bool
    started: float


CallT = TypeVar("CallT", bound=RetryCall)
ResultT = TypeVar("ResultT")


def make_retrying(
    policy: RetryPolicy,
    attempt: Callable[[CallT], ResultT],
    before_wait: Callable[[CallT, EngineError, int], None],
) -> Callable[[CallT], ResultT]:
    """Wrap one-attempt function ``attempt(call)`` in the policy's retries, built once per client.

    Args:
        policy: The retry policy.
        attempt: Sends exactly one request for ``call``; raises an ``EngineError`` on failure.
        before_wait: Called after a retriable failure and before the wait (the proactive adapter load).
            It must not raise; if it does, the error is logged and the retry goes on.

    Returns:
        A function with ``attempt``'s signature that retries per the policy and raises the last error, its
        ``attempts`` field set, when retries run out or the error is never retried.
    """
    glue = _BackoffGlue(policy, before_wait)
    decorated: Callable[[CallT], ResultT] = backoff.on_exception(
        glue.waits,
        EngineError,
        max_tries=policy.max_attempts,
        jitter=None,  # applied in ``waits``, so Retry-After is never jittered below its value
        giveup=glue.is_final,
        on_backoff=glue.on_backoff,
        on_giveup=glue.on_giveup,
        logger=None,  # backoff's own ERROR line on give-up would duplicate the raised error
    )(attempt)
    return decorated


class _BackoffGlue:
    """The policy as backoff's callbacks: the wait generator, the give-up test and the two event handlers."""

    def __init__(self, policy: RetryPolicy, before_wait: Callable[[Any, EngineError, int], None]):
        self._policy = policy
        self._before_wait = before_wait

    def waits(self) -> Generator[float, Any, None]:
        """Yield each wait; backoff primes it with ``send(None)``, then sends each failed attempt's exception."""
        error = yield 0.0
        for nominal in self._policy.delays():
            error = yield self._policy.wait_for(nominal, error)

    def is_final(self, error: BaseException) -> bool:
        """Tell backoff to stop: the table says this error is never retried."""
        return not self._policy.should_retry(error)

    def _read(self, details: Mapping[str, Any]) -> Tuple[RetryCall, RetryEvent]:
        """Read one failed attempt as backoff reports it (the only reader of its dict): the call, and the
        ``RetryEvent`` the hooks receive (its ``cause`` the attempt's error; its wait 0 on give-up)."""
        call, error, tries = details["args"][0], details["exception"], details["tries"]
        elapsed, wait = time.monotonic() - call.started, details.get("wait") or 0.0
        max_attempts = self._policy.max_attempts
        return call, RetryEvent(tries, max_attempts, wait, elapsed, error, call.model, call.is_adapter)

    def on_backoff(self, details: Mapping[str, Any]) -> None:
        """Before a wait: the proactive load (best-effort), the INFO line, then the user's ``on_retry`` hooks."""
        call, event = self._read(details)
        error = event.cause
        try:
            self._before_wait(call, error, event.attempt)
        except Exception:  # best-effort by contract: never replaces the engine error
            logger.exception("lora_sampler: preparing the retry of %r failed", call.model)
        logger.info(
            "Retrying %s %r: attempt %d of %d failed (%s; request id %s); next attempt in %.3f s",
            "LoRA adapter" if call.is_adapter else "base model",
            call.model,
            event.attempt,
            event.max_attempts,
            short_cause(error),
            error.request_id or "none",
            event.wait,
        )
        _call_hooks(self._policy.on_retry, event)

    def on_giveup(self, details: Mapping[str, Any]) -> None:
        """On the last failure: stamp the attempts on the error; ``on_giveup`` hooks only if retries ran out."""
        _, event = self._read(details)
        event.cause.attempts = event.attempt
        if self._policy.should_retry(event.cause):  # errors never retried fire no give-up hook
            _call_hooks(self._policy.on_giveup, event)


def _call_hooks(hooks: Hooks, event: RetryEvent) -> None:
    for hook in cast(Tuple[Callable[[RetryEvent], None], ...], hooks):  # normalised by RetryPolicy
        try:
            hook(event)
        except Exception:  # a user's hook must never replace the engine error
            logger.exception("lora_sampler: retry hook %r raised", hook)
