"""``run_batch``: one JSONL input through a ready client into a resumable JSONL output, with the terminal around it.

The job of ``lora-sampler sample`` and ``score`` (and so of ``demo``, which runs ``sample``), from their flags. It owns
the resume step, the progress bar, Ctrl-C and the summary; the streaming itself is ``BatchJob``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import time
from typing import IO, Any, Dict, Iterable, Iterator, Optional, Tuple

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.progress import ProgressBar
from lora_sampler.batch._job import BatchJob, BatchStats
from lora_sampler.batch._lines import (
    PROMPT_LINES,
    InputLine,
    LineDefaults,
    LineFormat,
    ResumeState,
    count_lines,
    open_output,
    read_input,
)
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.cli._parser import UsageError
from lora_sampler.cli._terminal import counting_rows, interrupts_stop
from lora_sampler.openai_batch import BATCH_LINES, OPENAI_BATCH_FORMAT, first_line, is_batch_line
from lora_sampler.types import Adapter

logger = logging.getLogger(__name__)

#: Exit statuses: 0 ok, 1 some prompts failed, 2 usage, input or engine-unusable error, 130 interrupted.
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class BatchAbandoned(Exception):
    """Requests were still in flight when the grace period after Ctrl-C ended (the output stays resumable)."""


def run_batch(
    client: SamplerClient,
    args: argparse.Namespace,
    settings: SweepSettings,
    defaults: LineDefaults,
    source: Iterable[bytes],
    line_format: LineFormat,
) -> int:
    """Stream ``source`` (the input ``job_input`` opened) to ``args.output`` through ``client``; return the exit
    status.

    Args:
        client: A client whose engine (and adapter) passed the preflight; its ``max_workers`` is the concurrency.
        args: The job's flags (``sample``'s, ``score``'s): ``--input`` (its name in messages; a file is counted for
            the bar), ``--output`` (``-`` writes stdout, no resume; an existing file is resumed), ``--ordered``,
            ``--no-retry-failed``, ``--quiet``, ``--limit`` (the first N lines, blank lines not counted) and
            ``--restart``.
        settings: The job's settings (``settings_from``'s, checked): ``--max-outage``, ``--prompts-per-request``.
        defaults: What every line gets unless it says otherwise; its adapter or base model is what every line
            samples (neither: OpenAI batch lines name theirs, in body.model).
        source: The input's lines and ``line_format`` their kind and records (``job_input``).

    Raises:
        OutputSettingsError: the output holds answers made with other settings (or an answered line changed).
        LoraSamplerError: the job stopped on its own (a duplicate id, an unusable engine, an outage too long).
        BatchAbandoned: the second Ctrl-C left requests in flight.
    """
    model = defaults.adapter.name if isinstance(defaults.adapter, Adapter) else defaults.base_model
    with contextlib.ExitStack() as stack:
        lines, total = _lines_of(client, source, args, defaults, line_format)
        state, output = (ResumeState(), sys.stdout)
        if args.output != "-":
            state, output = _resume(stack, args, line_format, line_format.settings(defaults, model))
        view = ProgressBar(total, lambda: client.retries, unit="line", terminal=True, quiet=args.quiet)
        stack.callback(view.close)
        job = BatchJob(
            client,
            lines,
            output,
            resume=state,
            settings=settings,
            ordered=args.ordered,
            model=model,
            on_event=counting_rows(view, line_format.message_of),
            on_outage=view.on_outage,
            line_format=line_format,
        )
        with interrupts_stop(job) as interrupts:
            stats = job.run()
    if not args.quiet:
        _print_summary(stats, client.retries)
    if job.abandoned:
        raise BatchAbandoned
    return exit_status(interrupts.count, bool(stats.failed or state.kept_errors), f"--output {args.output}", job.fatal)


def _lines_of(
    client: SamplerClient,
    source: Iterable[bytes],
    args: argparse.Namespace,
    defaults: LineDefaults,
    line_format: LineFormat,
) -> Tuple[Iterator[InputLine], Optional[int]]:
    """The input's lines (parsed lazily in their format, up to ``--limit``), and how many lines the bar counts to
    (None for stdin without a limit: it cannot be counted)."""
    if line_format is BATCH_LINES and defaults.adapter is None and defaults.base_model is None:
        # body.model names a base model when the engine serves it (--adapter/--base-model override body.model)
        defaults = dataclasses.replace(defaults, base_models=client.served_base_models())
    name = "<stdin>" if args.input == "-" else args.input
    lines = read_input(source, defaults, name=name, parse=line_format.parse)
    total = None if args.input == "-" else count_lines(args.input)  # cheap for a file
    if args.limit is not None:
        lines = itertools.islice(lines, args.limit)
        total = args.limit if total is None else min(total, args.limit)
    return lines, total


def exit_status(interrupts: int, failed: bool, resume: str, fatal: Optional[BaseException] = None) -> int:
    """The exit status of a finished job (``sample``'s, ``score``'s, ``sweep``'s), or the error that stopped it.

    Args:
        interrupts: How many times Ctrl-C was pressed: 130, saying how to resume (``resume``: the flag naming the
            output, ``--output out.jsonl``).
        failed: Some lines or checkpoints failed: 1 (else 0).
        fatal: What stopped the job on its own, raised unless the job was interrupted.
    """
    if interrupts:
        print(f"lora-sampler: interrupted; run again with {resume} to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if fatal is not None:
        raise fatal
    return EXIT_FAILED if failed else EXIT_OK


def _resume(
    stack: contextlib.ExitStack, args: argparse.Namespace, line_format: LineFormat, settings: Dict[str, Any]
) -> Tuple[ResumeState, IO[str]]:
    """Open the output for the rest of the run (its one-writer lock held), say what resuming repaired.

    Returns:
        What it already holds (the resume set), and the stream to append records to.
    """
    opened = open_output(
        args.output,
        retry_failed=not args.no_retry_failed,
        key_of=line_format.key_of,
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


@contextlib.contextmanager
def job_input(
    args: argparse.Namespace, line_format: Optional[LineFormat] = None
) -> Iterator[Tuple[Iterable[bytes], LineFormat]]:
    """Open ``--input`` (``-`` reads stdin) for the block, its format read before any request: ``score``'s fixed
    ``line_format``, or ``sample``'s ``--format`` (auto: openai-batch when the first non-blank line is one).

    Yields:
        The input's lines (none consumed) and their kind and records.

    Raises:
        UsageError: ``--input`` is no file, or it holds prompt lines (which name no model) without ``--adapter`` or
            ``--base-model``; an input of blank lines is an empty job (exit 0, an empty output), as vLLM's
            run-batch.
    """
    if args.input != "-" and not os.path.isfile(args.input):
        raise UsageError(f"--input {args.input} is not a file; pass a JSONL file, or - to read stdin")
    with contextlib.nullcontext(sys.stdin.buffer) if args.input == "-" else open(args.input, "rb") as source:
        yield (source, line_format) if line_format is not None else _sample_format(source, args)


def _sample_format(source: Iterable[bytes], args: argparse.Namespace) -> Tuple[Iterable[bytes], LineFormat]:
    """The lines of ``sample``'s input (none consumed) and their kind, by ``--format`` (auto: from the first line)."""
    first, lines = first_line(source)
    auto = args.format == "auto" and first is not None and is_batch_line(first)
    if auto or args.format == OPENAI_BATCH_FORMAT:
        return lines, BATCH_LINES
    if first is not None and not (args.adapter or args.base_model):
        raise UsageError(
            "the input holds prompt lines, which name no model: pass --adapter or --base-model (only OpenAI batch "
            "lines name their model, in body.model)"
        )
    return lines, PROMPT_LINES
