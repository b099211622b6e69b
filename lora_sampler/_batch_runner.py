"""``run_batch``: one JSONL input through a ready client into a resumable JSONL output, with the terminal around it.

A plain function of a client and paths (no argparse), so ``lora-sampler sample`` and ``lora-sampler demo`` share it.
It owns the resume step, the progress bar, Ctrl-C and the summary; the streaming itself is ``BatchJob``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Dict, Optional

from lora_sampler._batch_job import BatchJob
from lora_sampler._outage import OutageEvent
from lora_sampler._terminal import RetryCounter, interrupts_stop, logs_above, progress_bar, say
from lora_sampler.batch import InputLine, LineDefaults, count_lines, prepare_output, read_input
from lora_sampler.client import SamplerClient

logger = logging.getLogger(__name__)

#: Exit statuses: 0 ok, 1 some prompts failed, 2 usage, input or engine-unusable error, 130 interrupted.
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class BatchAbandoned(Exception):
    """Requests were still in flight when the grace period after Ctrl-C ended (the output stays resumable)."""


def run_batch(
    client: SamplerClient,
    input_path: str,
    output_path: str,
    defaults: LineDefaults,
    *,
    model: str,
    ordered: bool = False,
    retry_failed: bool = True,
    quiet: bool = False,
    max_outage: float = 0.0,
    retries: Optional[RetryCounter] = None,
) -> int:
    """Stream ``input_path`` to ``output_path`` through ``client``; return the exit status.

    Args:
        client: A client whose engine (and adapter) passed the preflight; its ``max_workers`` is the concurrency.
        input_path: JSONL prompts; ``-`` reads stdin.
        output_path: JSONL results; ``-`` writes stdout (no resume). An existing file is resumed.
        defaults: What every line gets unless it says otherwise.
        model: The adapter or base-model name, for error records.
        ordered: Write records in input order.
        retry_failed: On resume, run failed ids again.
        quiet: No progress bar and no summary.
        max_outage: Seconds to wait out an engine outage before stopping (0: fail fast).
        retries: The counter fed by the client's retry hook, shown on the bar and in the summary.

    Raises:
        LoraSamplerError: the job stopped on its own (a duplicate id, an unusable engine, an outage too long).
        BatchAbandoned: the second Ctrl-C left requests in flight.
    """
    retries = retries or RetryCounter()
    to_file = output_path != "-"
    state = prepare_output(output_path, retry_failed=retry_failed) if to_file else None
    if state is not None and (state.dropped_errors or state.dropped_torn):
        logger.warning(
            "Resuming %s: %d ids answered, %d failed ids run again, %d torn lines repaired",
            output_path,
            len(state.done),
            state.dropped_errors,
            state.dropped_torn,
        )
    total = None if input_path == "-" else count_lines(input_path)  # cheap for a file; stdin cannot be counted
    bar = progress_bar(total, quiet)
    with contextlib.ExitStack() as stack:
        if bar is not None:
            stack.callback(bar.close)
        source = sys.stdin.buffer if input_path == "-" else stack.enter_context(open(input_path, "rb"))
        output = stack.enter_context(open(output_path, "a", encoding="utf-8")) if to_file else sys.stdout
        lines = read_input(source, defaults, name="<stdin>" if input_path == "-" else input_path)

        def show(**extra: Any) -> None:
            if bar is not None:
                bar.set_postfix(retries=retries.value, failed=job.stats.failed, **extra, refresh=False)

        def on_event(kind: str, line: InputLine, record: Optional[Dict[str, Any]]) -> None:
            if kind == "failed" and record is not None:
                error = record["error"]
                where = "" if error["type"] == "BatchInputError" else f"line {line.line_number} (id {line.id!r}): "
                say(bar, f"lora-sampler: {where}{error['message']}")
            if bar is not None:
                bar.update(1)
                show()

        def on_outage(event: OutageEvent) -> None:  # worker threads; tqdm holds its own lock
            if bar is not None:
                show(**({"engine": f"away {event.waited:.0f}/{event.max_outage:g} s"} if event.kind != "back" else {}))
                bar.refresh()

        job = BatchJob(
            client,
            lines,
            output,
            done=state.done if state else set(),
            ordered=ordered,
            model=model,
            on_event=on_event,
            max_outage=max_outage,
            on_outage=on_outage,
        )
        with interrupts_stop(job) as interrupts, logs_above(bar):
            stats = job.run()
    wall = time.monotonic() - stats.started
    if not quiet:
        rate = (stats.done + stats.failed) / wall if wall > 0 else 0.0
        print(
            f"lora-sampler: {stats.done} done, {stats.failed} failed, {stats.skipped} skipped, {retries.value} "
            f"retries in {wall:.1f} s ({rate:.1f} requests/s)",
            file=sys.stderr,
        )
    if job.abandoned:
        raise BatchAbandoned
    if interrupts.count:
        print(f"lora-sampler: interrupted; run again with --output {output_path} to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if job.fatal is not None:
        raise job.fatal
    return EXIT_FAILED if stats.failed or (state is not None and state.kept_errors) else EXIT_OK
