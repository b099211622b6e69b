"""``run_batch``: one JSONL input through a ready client into a resumable JSONL output, with the terminal around it.

The job of ``lora-sampler sample`` and ``score`` (and so of ``demo``, which runs ``sample``), from their flags. It owns
the resume step, the progress bar, Ctrl-C and the summary; the streaming itself is ``BatchJob``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import logging
import sys
import time
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
from lora_sampler.cli._terminal import counting_rows, interrupts_stop, logs_above
from lora_sampler.errors import BatchInputError
from lora_sampler.openai_batch import (
    OPENAI_BATCH_RECORDS,
    PROMPT_FORMAT,
    detect_format,
    first_line,
    parse_batch_line,
)
from lora_sampler.types import Adapter

logger = logging.getLogger(__name__)

#: Exit statuses: 0 ok, 1 some prompts failed, 2 usage, input or engine-unusable error, 130 interrupted.
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class BatchAbandoned(Exception):
    """Requests were still in flight when the grace period after Ctrl-C ended (the output stays resumable)."""


def run_batch(
    client: SamplerClient, args: argparse.Namespace, defaults: LineDefaults, line_format: Optional[LineFormat] = None
) -> int:
    """Stream ``args.input`` to ``args.output`` through ``client``; return the exit status.

    Args:
        client: A client whose engine (and adapter) passed the preflight; its ``max_workers`` is the concurrency.
        args: The job's flags (``sample``'s, ``score``'s): ``--input`` (``-`` reads stdin), ``--output`` (``-``
            writes stdout, no resume; an existing file is resumed), ``--format``, ``--ordered``,
            ``--no-retry-failed``, ``--quiet``, ``--max-outage``, ``--limit`` (the first N lines, blank lines not
            counted), ``--prompts-per-request`` and ``--restart``.
        defaults: What every line gets unless it says otherwise; its adapter or base model is what every line
            samples (neither: OpenAI batch lines name theirs, in body.model).
        line_format: A fixed kind of line and record (``score``'s) instead of ``--format``.

    Raises:
        OutputSettingsError: the output holds answers made with other settings (or an answered line changed).
        LoraSamplerError: the job stopped on its own (a duplicate id, an unusable engine, an outage too long), or
            prompt lines came without a model to sample.
        BatchAbandoned: the second Ctrl-C left requests in flight.
    """
    model = defaults.adapter.name if isinstance(defaults.adapter, Adapter) else defaults.base_model
    with contextlib.ExitStack() as stack:
        source = sys.stdin.buffer if args.input == "-" else stack.enter_context(open(args.input, "rb"))
        lines, records, total = _lines_of(client, source, args, defaults, line_format)
        state, output = (ResumeState(), sys.stdout)
        if args.output != "-":
            state, output = _resume(stack, args, records, records.settings(defaults, model))
        view = ProgressBar(total, lambda: client.retries, unit="line", terminal=True, quiet=args.quiet)
        stack.callback(view.close)
        job = BatchJob(
            client,
            lines,
            output,
            done=state.done,
            memory=state.memory,
            ordered=args.ordered,
            model=model,
            on_event=counting_rows(view, records.message_of),
            max_outage=args.max_outage,
            on_outage=view.on_outage,
            records=records,
            unusable_errors=UNUSABLE_ERRORS if model is not None else ENGINE_WIDE_ERRORS,  # None: a model per line
            prompts_per_request=args.prompts_per_request,
        )
        with interrupts_stop(job) as interrupts, logs_above(view):
            stats = job.run()
    if not args.quiet:
        _print_summary(stats, client.retries)
    return _exit_status(job, interrupts.count, bool(stats.failed or state.kept_errors), args.output)


def _lines_of(
    client: SamplerClient,
    source: Iterable[bytes],
    args: argparse.Namespace,
    defaults: LineDefaults,
    line_format: Optional[LineFormat],
) -> Tuple[Iterator[InputLine], RecordFormat, Optional[int]]:
    """The input's lines (parsed lazily in their format, up to ``--limit``), the records' format, and how many lines
    the bar counts to (None for stdin without a limit: it cannot be counted)."""
    if line_format is None:
        model = defaults.adapter if defaults.adapter is not None else defaults.base_model
        source, records, parse = _input_format(client, source, args.format, model is not None)
    else:
        records, parse = line_format.records, line_format.parse
    lines = read_input(source, defaults, name="<stdin>" if args.input == "-" else args.input, parse=parse)
    total = None if args.input == "-" else count_lines(args.input)  # cheap for a file
    if args.limit is not None:
        lines = itertools.islice(lines, args.limit)
        total = args.limit if total is None else min(total, args.limit)
    return lines, records, total


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
    stack: contextlib.ExitStack, args: argparse.Namespace, records: RecordFormat, settings: Dict[str, Any]
) -> Tuple[ResumeState, IO[str]]:
    """Open the output for the rest of the run (its one-writer lock held), say what resuming repaired.

    Returns:
        What it already holds (the resume set), and the stream to append records to.
    """
    opened = open_output(
        args.output,
        retry_failed=not args.no_retry_failed,
        key_of=records.key_of,
        settings=settings,
        restart=args.restart,
    )
    state, output = stack.enter_context(opened)
    if state.dropped_errors or state.dropped_torn:
        logger.warning(
            "Resuming %s: %d ids answered, %d failed ids run again, %d torn lines repaired",
            args.output,
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
    client: SamplerClient, source: Iterable[bytes], input_format: str, has_model: bool
) -> Tuple[Iterable[bytes], RecordFormat, LineParser]:
    """Return the input's lines (none consumed), the output format and the line parser, by the input's format
    (``--format``: auto, prompts or openai-batch); ``has_model``: ``--adapter`` or ``--base-model`` was given."""
    found, lines = detect_format(source)
    chosen = found if input_format == "auto" else input_format
    if chosen == PROMPT_FORMAT:
        first, lines = first_line(lines)
        if not has_model and first is not None:  # an input of blank lines is an empty job: exit 0, empty output
            raise BatchInputError(
                "the input holds prompt lines, which name no model: pass --adapter or --base-model (only OpenAI "
                "batch lines name their model, in body.model)"
            )
        return lines, PROMPT_RECORDS, parse_line
    if has_model:  # --adapter/--base-model override body.model (LineDefaults carries them)
        return lines, OPENAI_BATCH_RECORDS, parse_batch_line
    base_models = frozenset(client.served_base_models())  # body.model names a base model when the engine serves it
    return lines, OPENAI_BATCH_RECORDS, functools.partial(parse_batch_line, base_models=base_models)
