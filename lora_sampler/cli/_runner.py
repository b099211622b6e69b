"""``run_batch``: one JSONL input through a ready client into a resumable JSONL output, with the terminal around it.

A plain function of a client and paths (no argparse), so ``lora-sampler sample`` and ``lora-sampler demo`` share it.
It owns the resume step, the progress bar, Ctrl-C and the summary; the streaming itself is ``BatchJob``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Dict, Iterable, Iterator, Optional, Tuple

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.progress import ProgressBar
from lora_sampler.batch._job import ENGINE_WIDE_ERRORS, UNUSABLE_ERRORS, BatchJob, BatchStats
from lora_sampler.batch._lines import (
    PROMPT_RECORDS,
    InputLine,
    LineDefaults,
    LineFormat,
    LineParser,
    RecordFormat,
    ResumeState,
    count_lines,
    open_output,
    parse_line,
    read_input,
)
from lora_sampler.batch._openai import (
    OPENAI_BATCH_FORMAT,
    OPENAI_BATCH_RECORDS,
    PROMPT_FORMAT,
    detect_format,
    first_line,
    parse_batch_line,
)
from lora_sampler.cli._terminal import counting_rows, interrupts_stop, logs_above
from lora_sampler.errors import BatchInputError

logger = logging.getLogger(__name__)

#: Exit statuses: 0 ok, 1 some prompts failed, 2 usage, input or engine-unusable error, 130 interrupted.
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class BatchAbandoned(Exception):
    """Requests were still in flight when the grace period after Ctrl-C ended (the output stays resumable)."""


@dataclass(frozen=True)
class BatchRun:
    """One command-line job: where its lines come from and go, and how it runs (``sample``, ``score``, ``demo``).

    Attributes:
        input_path: JSONL prompts; ``-`` reads stdin.
        output_path: JSONL results; ``-`` writes stdout (no resume). An existing file is resumed.
        model: The adapter or base-model name every line samples; None when batch lines name theirs (body.model).
        input_format: ``jsonl`` (prompt or messages lines), ``openai-batch`` (OpenAI batch lines; output in the
            ``vllm run-batch`` shape, resumed by custom_id) or ``auto`` (batch when the first line has custom_id
            and body).
        ordered: Write records in input order.
        retry_failed: On resume, run failed ids again.
        quiet: No progress bar and no summary.
        max_outage: Seconds to wait out an engine outage before stopping (0: fail fast).
        line_format: A fixed kind of line and record (e.g. ``lora-sampler score``'s) instead of ``input_format``.
        limit: Run only the first ``limit`` lines of the input (blank lines not counted); a resume with the same
            limit covers the same lines.
        prompts_per_request: Lines sent together in one completion request (None: the measured defaults).
        restart: Empty the output first (every line runs again) instead of resuming it.
    """

    input_path: str
    output_path: str
    model: Optional[str]
    input_format: str = "auto"
    ordered: bool = False
    retry_failed: bool = True
    quiet: bool = False
    max_outage: float = 0.0
    line_format: Optional[LineFormat] = None
    limit: Optional[int] = None
    prompts_per_request: Optional[int] = None
    restart: bool = False


def run_batch(client: SamplerClient, run: BatchRun, defaults: LineDefaults) -> int:
    """Stream ``run.input_path`` to ``run.output_path`` through ``client``; return the exit status.

    Args:
        client: A client whose engine (and adapter) passed the preflight; its ``max_workers`` is the concurrency.
        run: The input, the output and how the job runs.
        defaults: What every line gets unless it says otherwise.

    Raises:
        OutputSettingsError: the output holds answers made with other settings (or an answered line changed).
        LoraSamplerError: the job stopped on its own (a duplicate id, an unusable engine, an outage too long), or
            prompt lines came without a model to sample.
        BatchAbandoned: the second Ctrl-C left requests in flight.
    """
    with contextlib.ExitStack() as stack:
        source = sys.stdin.buffer if run.input_path == "-" else stack.enter_context(open(run.input_path, "rb"))
        lines, records, total = _lines_of(client, source, run, defaults)
        state, output = (ResumeState(), sys.stdout)
        if run.output_path != "-":
            state, output = _resume(stack, run, records, records.settings(defaults, run.model))
        view = ProgressBar(total, lambda: client.retries, unit="line", terminal=True, quiet=run.quiet)
        stack.callback(view.close)
        job = _new_job(client, run, lines, output, state, records, view)
        with interrupts_stop(job) as interrupts, logs_above(view):
            stats = job.run()
    if not run.quiet:
        _print_summary(stats, client.retries)
    return _exit_status(job, interrupts.count, bool(stats.failed or state.kept_errors), run.output_path)


def _lines_of(
    client: SamplerClient, source: Iterable[bytes], run: BatchRun, defaults: LineDefaults
) -> Tuple[Iterator[InputLine], RecordFormat, Optional[int]]:
    """The run's input lines (parsed lazily, up to ``limit``), the records' format, and how many lines the bar
    counts to (None for stdin without a limit: it cannot be counted)."""
    lines, records = _read_input(client, source, run, defaults)
    total = None if run.input_path == "-" else count_lines(run.input_path)  # cheap for a file
    if run.limit is not None:
        lines = itertools.islice(lines, run.limit)
        total = run.limit if total is None else min(total, run.limit)
    return lines, records, total


def _read_input(
    client: SamplerClient, source: Iterable[bytes], run: BatchRun, defaults: LineDefaults
) -> Tuple[Iterator[InputLine], RecordFormat]:
    """Return the input's lines, parsed lazily in their format, and the format of their output records."""
    if run.line_format is not None:
        raw_lines, records, parse = source, run.line_format.records, run.line_format.parse
    else:
        raw_lines, records, parse = _input_format(client, source, run.input_format, run.model)
    name = "<stdin>" if run.input_path == "-" else run.input_path
    return read_input(raw_lines, defaults, name=name, parse=parse), records


def _new_job(
    client: SamplerClient,
    run: BatchRun,
    lines: Iterator[InputLine],
    output: IO[str],
    state: ResumeState,
    records: RecordFormat,
    view: ProgressBar,
) -> BatchJob:
    """The job streaming ``lines`` to ``output``, reporting to ``view``; stopped by errors the whole job shares."""
    return BatchJob(
        client,
        lines,
        output,
        done=state.done,
        memory=state.memory,
        ordered=run.ordered,
        model=run.model,
        on_event=counting_rows(view, records.message_of),
        max_outage=run.max_outage,
        on_outage=view.on_outage,
        records=records,
        unusable_errors=UNUSABLE_ERRORS if run.model is not None else ENGINE_WIDE_ERRORS,  # None: a model per line
        prompts_per_request=run.prompts_per_request,
    )


def _exit_status(job: BatchJob, interrupts: int, failures: bool, output_path: str) -> int:
    """The exit status of a finished job, or the error that stopped it.

    Raises:
        BatchAbandoned: requests were left in flight after the second Ctrl-C.
        LoraSamplerError: the job stopped on its own (``job.fatal``).
    """
    if job.abandoned:
        raise BatchAbandoned
    if interrupts:
        print(f"lora-sampler: interrupted; run again with --output {output_path} to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if job.fatal is not None:
        raise job.fatal
    return EXIT_FAILED if failures else EXIT_OK


def _resume(
    stack: contextlib.ExitStack, run: BatchRun, records: RecordFormat, settings: Dict[str, Any]
) -> Tuple[ResumeState, IO[str]]:
    """Open the output for the rest of the run (its one-writer lock held), say what resuming repaired.

    Returns:
        What it already holds (the resume set), and the stream to append records to.
    """
    opened = open_output(
        run.output_path, retry_failed=run.retry_failed, key_of=records.key_of, settings=settings, restart=run.restart
    )
    state, output = stack.enter_context(opened)
    if state.dropped_errors or state.dropped_torn:
        logger.warning(
            "Resuming %s: %d ids answered, %d failed ids run again, %d torn lines repaired",
            run.output_path,
            len(state.done),
            state.dropped_errors,
            state.dropped_torn,
        )
    return state, output


def _print_summary(stats: BatchStats, retries: int) -> None:
    """Print the job's one-line summary on stderr: counts, retries, time and rate."""
    wall = time.monotonic() - stats.started
    rate = (stats.done + stats.failed) / wall if wall > 0 else 0.0
    print(
        f"lora-sampler: {stats.done} done, {stats.failed} failed, {stats.skipped} skipped, {retries} "
        f"retries in {wall:.1f} s ({rate:.1f} requests/s)",
        file=sys.stderr,
    )


def _input_format(
    client: SamplerClient, source: Iterable[bytes], input_format: str, model: Optional[str]
) -> Tuple[Iterable[bytes], RecordFormat, LineParser]:
    """Return the input's lines (none consumed), the output format and the line parser, by the input's format."""
    found, lines = detect_format(source)
    chosen = found if input_format == "auto" else input_format
    if chosen == PROMPT_FORMAT:
        first, lines = first_line(lines)
        if model is None and first is not None:  # an input of blank lines is an empty job: exit 0, empty output
            raise BatchInputError(
                "the input holds prompt lines, which name no model: pass --adapter or --base-model (only OpenAI "
                "batch lines name their model, in body.model)"
            )
        return lines, PROMPT_RECORDS, parse_line
    if chosen != OPENAI_BATCH_FORMAT:
        raise ValueError(f"input_format must be auto, {PROMPT_FORMAT} or {OPENAI_BATCH_FORMAT}, got {input_format!r}")
    if model is not None:  # --adapter/--base-model override body.model (LineDefaults carries them)
        return lines, OPENAI_BATCH_RECORDS, parse_batch_line
    base_models = frozenset(client.served_base_models())  # body.model names a base model when the engine serves it
    return lines, OPENAI_BATCH_RECORDS, functools.partial(parse_batch_line, base_models=base_models)
