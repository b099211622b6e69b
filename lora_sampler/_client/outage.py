"""Outages during long jobs: which failures mean "the engine is away", probing it, holding work meanwhile.

``is_outage`` reads a failure the retry table gave up on (its transport row, or vllm-router's no-worker answer);
``probe_until`` probes with capped backoff; ``OutageGate`` holds the requests of one ``imap`` call while the engine
is away and lets them run again once it answers. No HTTP of its own: the client hands in its probe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, TypeVar

from lora_sampler._wire.refusals import is_router_outage
from lora_sampler.errors import (
    EngineConnectionError,
    EngineStatusError,
    EngineTimeoutError,
    answered_by_gateway,
    short_cause,
)
from lora_sampler.retry import is_transport_failure
from lora_sampler.types import Timeout, split_timeout

logger = logging.getLogger(__name__)

#: The first wait between probes, in seconds; each later one doubles, up to ``PROBE_MAX_DELAY``.
PROBE_BASE_DELAY = 0.1
#: The longest wait between two probes, in seconds.
PROBE_MAX_DELAY = 2.0
#: A probe's read timeout is at most this many seconds: a hung engine is reported in seconds, not minutes.
PROBE_READ_TIMEOUT = 5.0

#: Seconds before an outage within which a 500 to a prompt-logprobs request is named as its likely cause.
LIKELY_CAUSE_WINDOW = 60.0
#: Where the docs explain the engine defect behind such an outage and its workaround.
PROMPT_LOGPROBS_DEFECT_DOC = "docs/guides/real-vllm.md"

T = TypeVar("T")


class PromptLogprobFailures:
    """Remembers the last 500 the engine answered to a request asking for prompt logprobs (scoring), to name it.

    vLLM 0.32 on CPU with ``--enable-lora`` dies when one engine step holds two or more requests and any asks for
    prompt logprobs: the requests of that step get a 500 (``EngineDeadError``), then the server stops answering. The
    outage hold that follows reads like a network problem unless its message names this likely cause.
    """

    def __init__(self) -> None:
        #: Monotonic time, wall clock and the engine's message; one tuple replaced whole, so read without a lock.
        self._last: Optional[Tuple[float, float, str]] = None

    def note(self, error: EngineStatusError) -> None:
        """Record a 5xx answer to a prompt-logprobs request."""
        self._last = (time.monotonic(), time.time(), short_cause(error))

    def likely_cause(self, since: float) -> Optional[str]:
        """Name the recorded 500 when it came within ``LIKELY_CAUSE_WINDOW`` s before ``since`` (monotonic)."""
        last = self._last
        if last is None or not since - LIKELY_CAUSE_WINDOW <= last[0] <= since + 1.0:
            return None
        return (
            f"likely cause: the engine answered 500 to a prompt-logprobs (scoring) request at "
            f"{time.strftime('%H:%M:%S', time.localtime(last[1]))} ({last[2]}) and stopped answering right after. "
            "vLLM 0.32 on CPU with --enable-lora dies when one engine step holds two or more requests and any asks "
            "for prompt logprobs; restart it with --max-num-seqs 1, or score one request at a time (see "
            f"{PROMPT_LOGPROBS_DEFECT_DOC} in lora_sampler's docs)"
        )


def is_outage(error: BaseException) -> bool:
    """Tell whether a failure means the engine (or every worker behind a router) is away, not that a request is bad.

    Outage-class: the retry table's transport row (refused, reset, timeout) once retries gave up, the router's
    own 500 ``Request failed: error sending request for url ...`` and 503 ``No available workers ...``, and a
    proxy's 502, 504 or non-vLLM 503 (the engine behind it is away).
    """
    if is_transport_failure(error):
        return True
    if not isinstance(error, EngineStatusError):
        return False
    return is_router_outage(error.status, error.engine_message) or answered_by_gateway(
        error.response, error.engine_message
    )


def not_ready(error: BaseException) -> bool:
    """Tell whether a failed probe means "not back yet": an outage, or any 5xx (an engine still starting)."""
    status = getattr(error, "status", None)
    return is_outage(error) or (isinstance(status, int) and status >= 500)


def probe_timeout(timeout: Timeout) -> Tuple[float, float]:
    """Return the ``(connect, read)`` timeout of a probe: the client's connect timeout, a short read timeout."""
    connect, read = split_timeout(timeout)
    return connect, min(read, PROBE_READ_TIMEOUT)


def probe_until(
    probe: Callable[[], Any],
    deadline: float,
    *,
    pause: Optional[Callable[[float, BaseException], bool]] = None,
) -> Optional[BaseException]:
    """Call ``probe`` with capped backoff until it succeeds or ``deadline`` (monotonic) passes.

    The last probe is sent at the deadline, so a wait of N seconds ends within N seconds plus one probe.

    Args:
        probe: Raises while the engine is not ready; any other return means it answered.
        deadline: ``time.monotonic()`` value after which no probe is sent.
        pause: Waits the given seconds after a failed probe, given its error (e.g. to show the wait); True means
            give up at once (None: sleep).

    Returns:
        None once the engine answered, else the last probe's error.

    Raises:
        Exception: a probe failure that is not "not ready" (a refused API key), as raised by ``probe``.
    """
    delay = PROBE_BASE_DELAY
    while True:
        try:
            probe()
            return None
        except Exception as exc:
            if not not_ready(exc):
                raise
            last: BaseException = exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return last
        if pause is None:
            time.sleep(min(delay, remaining))
        elif pause(min(delay, remaining), last):
            return last
        delay = min(delay * 2, PROBE_MAX_DELAY)


@dataclass(frozen=True)
class OutageEvent:
    """What an ``on_outage`` hook is told while the engine is away. Holds no prompt and no API key.

    Attributes:
        kind: ``"held"`` (requests are being held), ``"waiting"`` (a probe failed; still waiting), ``"back"``
            (the engine answered; held requests run again) or ``"gave_up"`` (away longer than ``max_outage``).
        since: Wall-clock time (``time.time()``) the first request was held.
        waited: Seconds waited so far.
        max_outage: The limit, in seconds.
        held: Requests held right now.
        error: The last outage-class error.
    """

    kind: str
    since: float
    waited: float
    max_outage: float
    held: int
    error: BaseException


OutageHook = Callable[[OutageEvent], None]


class OutageGate:
    """Holds the requests of one fan-out while the engine is away, and runs them again once it answers.

    A request that fails outage-class is held (its worker thread waits here); no new request is sent; the held
    request that started the outage probes the engine. When the engine answers, every held request runs again (so
    the adapter-load race heals whatever the restart forgot). Past ``max_outage`` the held requests fail with their
    own last error and requests not yet sent fail without being sent; the gate stays failed. A request whose
    attempts straddled an outage runs again whatever its error (its retries were spent on a dead engine, and the
    restarted engine may have forgotten the adapter). A request only runs again after it failed, so none runs twice
    to completion, and none is dropped.

    Args:
        max_outage: Seconds to wait for the engine, > 0.
        probe: Raises while the engine is not ready (the client's ``GET /health`` then ``GET /v1/models``).
        base_url: The engine root, for messages.
        on_outage: Hook called with an ``OutageEvent`` (from worker threads; keep it quick, never let it block).
        on_back: Called once the engine answers again, before held requests run (e.g. to forget sent loads).
        likely_cause: Names what probably brought the engine down, given the outage's start (monotonic), or None.
    """

    def __init__(
        self,
        max_outage: float,
        probe: Callable[[], Any],
        *,
        base_url: str,
        on_outage: Optional[OutageHook] = None,
        on_back: Optional[Callable[[], None]] = None,
        likely_cause: Optional[Callable[[float], Optional[str]]] = None,
    ):
        self.max_outage = max_outage
        self._probe, self._base_url, self._on_outage, self._on_back = probe, base_url, on_outage, on_back
        self._likely_cause = likely_cause
        self._cond = threading.Condition()
        self._since: Optional[float] = None  # monotonic start of the current outage; None while the engine answers
        self._since_wall = 0.0
        self._episode = 0  # bumped whenever an outage ends
        self._held = 0
        self._last: Optional[BaseException] = None
        self._failed: Optional[str] = None  # why requests are no longer sent, once the gate gave up or was closed

    def run(self, call: Callable[[], T]) -> T:
        """Run ``call`` (one request), holding it through outages; raise its last error past ``max_outage``."""
        first_failure: Optional[float] = None
        while True:
            episode = self._enter()
            try:
                return call()
            except Exception as exc:
                if not is_outage(exc) or self._is_hung_but_healthy(exc):
                    if self._outage_during(episode):
                        continue  # its attempts straddled an outage (a restart that forgot the adapter): run again
                    raise
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.max_outage:
                    raise  # this request alone keeps failing while the engine answers probes: not held forever
                self._hold(exc, episode)

    def _is_hung_but_healthy(self, error: Exception) -> bool:
        """Tell whether a read timeout came from an engine that answers its probe at once: the request's failure.

        An engine that is away does not answer ``/health``; one that answers it but not the request is hung on
        that request (or its load), and holding the request would re-run it against the same hang until
        ``max_outage``. A connect timeout or a reset stays an outage.
        """
        if not isinstance(error, EngineTimeoutError) or isinstance(error, EngineConnectionError):
            return False
        try:
            self._probe()
        except Exception as probe_error:
            return not not_ready(probe_error)  # a refusal (401) is an answer too
        return True

    def close(self) -> None:
        """Release every held request (each fails with its last error) and stop probing; for an ended fan-out."""
        with self._cond:
            if self._failed is None:
                self._failed = f"not sent: the fan-out holding requests for the engine at {self._base_url} ended"
            self._cond.notify_all()

    def _enter(self) -> int:
        """Wait while the engine is away; return the outage count seen, or raise once the gate failed."""
        with self._cond:
            while self._since is not None and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise EngineConnectionError(self._failed)  # a fresh error per request: threads share no traceback
            return self._episode

    def _outage_during(self, episode: int) -> bool:
        """Tell whether an outage began since a request was sent in ``episode`` (ended or still going on)."""
        with self._cond:
            return self._failed is None and (self._episode != episode or self._since is not None)

    def _hold(self, error: Exception, episode: int) -> None:
        """Hold one failed request until the engine answers (return) or the wait is over (raise ``error``).

        A request whose outage ended meanwhile returns at once (it runs again). The request that starts an outage
        probes the engine, without the lock, until the outage ends; the others wait on the condition meanwhile.
        """
        with self._cond:
            if self._failed is not None:
                raise error
            if self._episode != episode:
                return
            self._last = error
            self._held += 1
            probes = self._since is None
            if probes:
                self._start(error)
        try:
            if not probes:
                with self._cond:
                    self._cond.wait_for(lambda: self._episode != episode or self._failed is not None)
            else:
                assert self._since is not None
                try:  # probe until the engine answers (None) or the outage outlasts max_outage (the last error)
                    outcome = probe_until(self._probe, self._since + self.max_outage, pause=self._wait_for_probe)
                except Exception:  # the engine answered, with a refusal: held requests run and report it
                    outcome = None
                with self._cond:
                    self._end(outcome)
        finally:
            with self._cond:
                self._held -= 1
                failed = self._failed is not None
        if failed:
            raise error

    def _start(self, error: Exception) -> None:
        """Start an outage (lock held): from now on no request is sent until it ends."""
        self._since, self._since_wall = time.monotonic(), time.time()
        logger.warning(
            "engine unreachable since %s; waiting up to %g s (the engine at %s: %s)%s",
            time.strftime("%H:%M:%S", time.localtime(self._since_wall)),
            self.max_outage,
            self._base_url,
            short_cause(error),
            self._cause_note(),
        )
        self._emit("held")

    def _wait_for_probe(self, seconds: float, error: BaseException) -> bool:
        """Say the engine is still away (``error``: the probe's), and wait ``seconds`` before the next probe; True as
        soon as the gate is closed (probing stops at once)."""
        self._emit("waiting", error)
        with self._cond:
            return self._cond.wait_for(lambda: self._failed is not None, seconds)

    def _end(self, probe_error: Optional[BaseException]) -> None:
        """End the current outage (lock held): the engine is back, or the gate fails for good."""
        assert self._since is not None
        waited = time.monotonic() - self._since
        if probe_error is None and self._failed is None:
            logger.warning("engine answered again after %.1f s; re-running %d held requests", waited, self._held)
            if self._on_back is not None:
                self._on_back()
            self._emit("back")
        elif self._failed is None:
            last = self._last if self._last is not None else probe_error
            logger.warning(
                "engine unreachable for %.1f s, longer than max_outage=%g s; held requests fail (%s)%s",
                waited,
                self.max_outage,
                short_cause(last),
                self._cause_note(),
            )
            self._emit("gave_up", probe_error)
            self._failed = (
                f"not sent: the engine at {self._base_url} was unreachable for {waited:.1f} s, longer than "
                f"max_outage={self.max_outage:g} s; the last error: {last}{self._cause_note()}"
            )
        self._since = None
        self._episode += 1
        self._cond.notify_all()

    def _cause_note(self) -> str:
        """``"; likely cause: ..."`` for the current outage when one is known, else ``""``."""
        if self._likely_cause is None or self._since is None:
            return ""
        cause = self._likely_cause(self._since)
        return f"; {cause}" if cause else ""

    def _emit(self, kind: str, error: Optional[BaseException] = None) -> None:
        if self._on_outage is None or self._since is None:
            return
        event = OutageEvent(
            kind=kind,
            since=self._since_wall,
            waited=time.monotonic() - self._since,
            max_outage=self.max_outage,
            held=self._held,
            error=error if error is not None else self._last or EngineConnectionError("engine unreachable"),
        )
        try:
            self._on_outage(event)
        except Exception:  # a user's hook must never break the fan-out
            logger.exception("lora_sampler: on_outage hook %r raised", self._on_outage)
