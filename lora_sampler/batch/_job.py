"""``BatchJob``: stream parsed input lines through ``SamplerClient.imap``/``imap_unordered`` into the output.

The client bounds the requests in flight; one pump thread drives it, and the calling thread alone writes records,
so a stop never tears a line. The pump is what lets a stop abandon requests still hung after its grace: the
client's iterators wait on their requests without a bound, so the calling thread returns at the deadline instead;
and it takes outcomes as fast as they come, so the client's window refills (and its batches fill) while records
are written. It stops on errors the whole job shares (an unusable engine, an outage too long).
It parses nothing and shows nothing: lines come in parsed, and progress leaves through ``on_event``.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageEvent, OutageHook, is_outage
from lora_sampler.batch._lines import PROMPT_LINES, InputLine, LineFormat, ResumeState, write_record
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.errors import (
    AdapterNotReadyError,
    AuthenticationError,
    BatchInputError,
    EngineConnectionError,
    EngineProtocolError,
    EngineTimeoutError,
    LoraSamplerError,
    ModelNotFoundError,
    PublishError,
)

#: Seconds in-flight requests get to finish after a stop request before they are abandoned.
DEFAULT_DRAIN_SECONDS = 5.0
#: Errors that do not depend on the line at all: a run of them means the engine is unusable.
ENGINE_WIDE_ERRORS = (EngineConnectionError, EngineTimeoutError, AuthenticationError)
#: Errors that do not depend on the prompt: a run of them means the engine or the adapter is unusable (when every
#: line samples the same model; a batch file names one per line, and then only ``ENGINE_WIDE_ERRORS`` count).
UNUSABLE_ERRORS = (*ENGINE_WIDE_ERRORS, ModelNotFoundError, AdapterNotReadyError, PublishError)


@dataclass
class BatchStats:
    """Counts of one run."""

    done: int = 0
    failed: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.monotonic)


_END = object()


class _Abandoned(Exception):
    """The calling thread stopped reading outcomes."""


Event = Callable[[str, InputLine, Optional[Dict[str, Any]]], None]


class BatchJob:
    """Stream input lines through a client and write one record per line, as results arrive.

    The client's ``imap``/``imap_unordered`` bound the requests in flight; a pump thread runs them and hands each
    outcome to the calling thread, which alone writes the output (so a stop never tears a line).

    Args:
        client: The client (its ``max_workers`` is the concurrency).
        lines: Parsed input lines (``read_input``).
        output: Text stream the records go to.
        resume: What the output already holds (``open_output``'s): the ids of its ``done`` are skipped, and its
            ``memory`` (when the output remembers its settings) remembers each record's request; an answered
            line that now asks something else stops the job (``fatal``).
        settings: The settings the job follows: ``fail_fast`` (consecutive prompt-independent failures after which
            it stops), ``max_outage`` (seconds to hold requests while the engine is away; 0: outages count towards
            ``fail_fast``; past it the job stops, saying how long it waited) and ``prompts_per_request`` (lines sent
            together in one completion request, as ``SamplerClient.imap`` takes it; None: the measured defaults).
        ordered: Write records in input order (bad lines then wait for the requests before them).
        model: The adapter or base-model name every line samples, for error records; None when each line names its
            own (an OpenAI batch file's), so only ``ENGINE_WIDE_ERRORS`` count towards ``fail_fast``.
        on_event: Called in the calling thread with ``("done"|"failed"|"skipped", line, record)``.
        on_outage: Also called with each ``OutageEvent`` (from worker threads), e.g. to show the wait.
        line_format: The lines' format, whose records are written (``PROMPT_LINES``, or
            ``openai_batch.BATCH_LINES``).
    """

    def __init__(
        self,
        client: SamplerClient,
        lines: Iterable[InputLine],
        output: IO[str],
        *,
        resume: ResumeState,
        settings: SweepSettings,
        ordered: bool = False,
        model: Optional[str] = None,
        on_event: Optional[Event] = None,
        on_outage: Optional[OutageHook] = None,
        line_format: LineFormat = PROMPT_LINES,
    ):
        self._client, self._lines, self._output, self._done = client, iter(lines), output, resume.done
        self._ordered, self._model, self._on_event, self._settings = ordered, model, on_event, settings
        self._on_outage = on_outage
        self._gave_up: Optional[OutageEvent] = None  # set (from a worker thread) once the outage outlasted the limit
        self._format = line_format
        self._unusable_errors = UNUSABLE_ERRORS if model is not None else ENGINE_WIDE_ERRORS
        self._memory = resume.memory
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=64)
        self._stopping = threading.Event()
        self._deadline: Optional[float] = None
        self.stats = BatchStats()
        self.abandoned = False
        #: Why the job stopped on its own (a duplicate id, an unusable engine), else None.
        self.fatal: Optional[LoraSamplerError] = None
        self._consecutive = 0

    def stop(self, grace: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Take no new lines; abandon the requests in flight after ``grace`` seconds (0: at once)."""
        self._stopping.set()
        deadline = time.monotonic() + grace
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def run(self) -> BatchStats:
        """Run to the end of the input, or to a stop; return the counts (see ``abandoned`` and ``fatal``)."""
        # In this thread's context: a sweep's mixing() (mix_adapters) covers the requests the pump hands the client.
        pump = threading.Thread(target=contextvars.copy_context().run, args=(self._pump,), name="lora_sampler-batch")
        pump.daemon = True
        pump.start()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self.abandoned = True  # in-flight requests are dropped; their ids run again on resume
                    return self.stats
                continue
            if item is _END:
                pump.join()
                return self.stats
            try:
                self._handle(*item)
            except LoraSamplerError:  # the output cannot be written: nothing more can be kept, so stop at once
                self.abandoned = True
                self._stopping.set()
                raise

    def _handle(self, kind: str, line: InputLine, outcome: Any) -> None:
        record: Optional[Dict[str, Any]] = None
        if kind == "fatal":
            self.fatal = self.fatal or outcome
            return
        if kind == "skipped":
            self.stats.skipped += 1
        elif not isinstance(outcome, (BaseException, str)):  # a SampleOutput, or a ScoreOutput
            record = self._format.result(line, outcome)
            self.stats.done += 1
            self._consecutive = 0
            kind = "done"
        else:
            record = self._format.error(line, outcome, None if isinstance(outcome, str) else self._model)
            self.stats.failed += 1
            kind = "failed"
            self._note_failure(outcome)
        if record is not None:
            if self._memory is not None:
                self._memory.remember(line.key, line.request)  # first: a kill between leaves a digest, not a record
            try:
                write_record(self._output, record)
            except RecursionError:  # an answer nested too deep to write back: its line gets an error record
                problem = EngineProtocolError("the engine's answer is nested too deep to write as JSON")
                record = self._format.error(line, problem, self._model)
                write_record(self._output, record)
                self.stats.done, self.stats.failed, kind = self.stats.done - 1, self.stats.failed + 1, "failed"
        if self._on_event is not None:
            self._on_event(kind, line, record)

    def _note_failure(self, error: Union[BaseException, str]) -> None:
        gave_up = self._gave_up
        if gave_up is not None and not isinstance(error, str) and is_outage(error) and self.fatal is None:
            self.fatal = LoraSamplerError(
                f"the engine at {self._client.base_url} was unreachable for {gave_up.waited:.1f} s, longer than "
                f"--max-outage {self._settings.max_outage:g} s; stopped. Run again with the same --output to resume. "
                f"The last error: {error}"
            )
            self._stopping.set()  # what is in flight is no longer sent: it fails at once and is written
            return
        self._consecutive = self._consecutive + 1 if isinstance(error, self._unusable_errors) else 0
        if self._consecutive >= self._settings.fail_fast and self.fatal is None:
            self.fatal = LoraSamplerError(
                f"stopped after {self._consecutive} consecutive failures that do not depend on the prompt; the "
                f"engine or the adapter is unusable. The last one: {error}"
            )
            self._stopping.set()  # no deadline: what is in flight fails or succeeds quickly, and is written

    def _put(self, item: Any) -> None:
        while True:  # never block forever: the calling thread may have abandoned the job
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if self.abandoned:
                    raise _Abandoned from None

    def _pump(self) -> None:
        try:
            try:
                for line, outcome in self._outcomes():
                    self._put(("result", line, outcome))
            except _Abandoned:
                raise
            except Exception as exc:  # a bug must surface in the calling thread, not die with this one
                fatal = exc if isinstance(exc, LoraSamplerError) else LoraSamplerError(f"batch job failed: {exc!r}")
                self._put(("fatal", None, fatal))
            self._put(_END)
        except _Abandoned:
            return  # nobody is reading any more: end this daemon thread quietly

    def _outcomes(self) -> Iterator[Tuple[InputLine, Any]]:
        """Yield each sent line with its outcome, in input order when ``ordered`` (runs in the pump thread).

        A bad line takes its slot in the client's fan-out as an item it refuses (never sent), so it comes out in
        its place, after the requests before it, with its own error as its outcome.
        """
        sent: Dict[int, InputLine] = {}
        fan_out = self._client.imap if self._ordered else self._client.imap_unordered
        outcomes = fan_out(
            self._requests(sent),
            return_exceptions=True,
            max_outage=self._settings.max_outage,
            on_outage=self._outage,
            prompts_per_request=self._settings.prompts_per_request,
        )
        for index, outcome in enumerate(outcomes) if self._ordered else outcomes:
            line = sent.pop(index)
            yield line, outcome if line.request is not None else line.error

    def _outage(self, event: OutageEvent) -> None:
        if event.kind == "gave_up":
            self._gave_up = event
        if self._on_outage is not None:
            self._on_outage(event)

    def _requests(self, sent: Dict[int, InputLine]) -> Iterator[Any]:
        """Yield the requests to send, and None for a bad line (an item the client refuses, never sending it),
        keeping each line by its index in ``sent``; report skipped lines on the way (runs in the pump thread)."""
        count = 0
        while not self._stopping.is_set():
            try:
                line = next(self._lines, None)
            except BatchInputError as exc:
                self._put(("fatal", None, exc))
                self._stopping.set()  # no deadline: what is in flight finishes and is written
                return
            if line is None:
                return
            if line.key not in self._done:
                sent[count] = line
                count += 1
                yield line.request
                continue
            refusal = None if self._memory is None else self._memory.refusal(line)
            if refusal is not None:
                self._put(("fatal", None, refusal))
                self._stopping.set()  # what is in flight finishes and is written
                return
            self._put(("skipped", line, None))
