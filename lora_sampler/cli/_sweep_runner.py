"""``lora-sampler sweep`` on the terminal: the progress bar, a line per finished checkpoint, Ctrl-C, the summary
table and ``--plot`` (matplotlib, the ``plot`` extra, imported only when a plot is drawn).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.progress import ProgressBar
from lora_sampler._views import printable
from lora_sampler.batch._evaluator import CheckpointEvaluator
from lora_sampler.batch._ledger import read_ledger
from lora_sampler.batch._lines import PROMPT_LINES, InputLine
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.batch._sources import Checkpoint, Manifest
from lora_sampler.batch._sweep import CheckpointReport, Sweep
from lora_sampler.cli._runner import BatchAbandoned, exit_status
from lora_sampler.cli._terminal import Interrupts, aligned, counting_rows, interrupts_stop

#: The summary table's columns, and the ledger field each shows.
COLUMNS = (
    ("checkpoint", "checkpoint"),
    ("rows", "rows"),
    ("failed", "failed"),
    ("mean logprob", "mean_logprob"),
    ("mean sum", "mean_sum"),
    ("mean length", "mean_length"),
    ("rows/s", "rows_per_second"),
)
#: The most panels ``--plot`` draws: an lm-eval group such as mmlu reports over a hundred numbers, and one panel
#: each made a strip no one can read (300 numbers: 700 x 75,250 pixels).
MAX_PLOT_PANELS = 60
_PLOT_EXTRA = "--plot needs matplotlib: pip install 'lora_sampler[plot]'"


def check_plot_dependency() -> None:
    """Fail before the sweep when ``--plot`` cannot be drawn.

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(_PLOT_EXTRA) from None


def run_sweep(
    client: SamplerClient,
    args: argparse.Namespace,
    settings: SweepSettings,
    evaluator: Optional[CheckpointEvaluator] = None,
) -> int:
    """Sweep the checkpoints the flags name (each through ``evaluator`` when given, else ``--input``'s lines); print
    each as it finishes and the table at the end; return the status."""
    bar = ProgressBar(None, lambda: client.retries, unit="line", terminal=True, quiet=args.quiet)
    on_event = counting_rows(bar, PROMPT_LINES.message_of)

    def on_row(checkpoint: Checkpoint, kind: str, line: InputLine, record: Optional[Dict[str, Any]]) -> None:
        on_event(kind, line, record)  # from several checkpoints' threads: the bar counts under its own lock

    checkpoints = Manifest(args.manifest) if args.manifest else list(args.checkpoints)

    def on_state(state: str) -> None:
        if not args.quiet:
            bar.say(f"lora-sampler: {state}")

    sweep = Sweep(
        client,
        checkpoints,
        None if evaluator is not None else args.input,
        settings,
        on_row=on_row,
        on_outage=bar.on_outage,
        evaluator=evaluator,
        on_state=on_state,
    )
    with interrupts_stop(sweep) as interrupts:  # to the table's end: a Ctrl-C as the sweep ends still gets it
        try:
            for report in sweep.run():
                if not args.quiet:
                    bar.say(report_line(report))
                for note in report.notes if not report.resumed else ():
                    bar.say(printable(f"lora-sampler: {report.checkpoint}: note: {note}"))
        finally:
            bar.close()
        if sweep.abandoned:
            raise BatchAbandoned
        entries = read_ledger(sweep.ledger_path) if sweep.ledger_path else []
        return _finish(entries, args, interrupts)


def report_line(report: CheckpointReport) -> str:
    """The line printed for a finished checkpoint: its name (control characters escaped), its rows (an evaluator's
    metrics, when it has any) or its error."""
    name = printable(report.checkpoint)
    if report.resumed:
        return f"lora-sampler: {name}: done by an earlier run ({report.rows} rows)"
    detail = report.error["message"] if report.error else f"{report.rows} rows, {report.failed} failed"
    if report.metrics and not report.error:
        detail = ", ".join(f"{metric} {_cell(value)}" for metric, value in report.metrics.items())
    return printable(f"lora-sampler: {name}: {detail} ({report.seconds:.1f} s)")


def _finish(entries: List[Dict[str, Any]], args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Print the table, draw the plot, and return the exit status from the whole ledger (130 once interrupted, a
    Ctrl-C while the table is printed included)."""
    if not args.quiet:
        print(summary_table(entries))
        for entry in entries:
            for note in entry.get("notes") or ():
                print(f"note: {_short(entry['checkpoint'])}: {note}")
    if args.plot:
        draw_plot(entries, args.plot)
        if not args.quiet:
            print(f"lora-sampler: plotted {len(entries)} checkpoints into {args.plot}", file=sys.stderr)
    failed = any("error" in entry or entry.get("failed") for entry in entries)
    return exit_status(interrupts.count, failed, f"--output-dir {args.output_dir}")


def summary_table(entries: Sequence[Dict[str, Any]]) -> str:
    """Return the summary table: one row per ledger line; an unusable checkpoint shows its error instead.

    The ``mean sum`` column (the mean log-likelihood per line) shows only for a scoring sweep; an evaluator sweep
    shows one column per metric instead of the row columns.
    """
    columns, shown = _columns(entries)
    rows, errors = [[title for title, _ in columns]], [""]
    for entry in shown:
        error = entry.get("error")
        cells = [] if error else [_cell(entry.get(key)) for _, key in columns[1:]]
        rows.append([_short(entry["checkpoint"]), *cells])
        errors.append(printable(f"  error: {error.get('type')}: {error.get('message')}") if error else "")
    return "\n".join((line + error).rstrip() for line, error in zip(aligned(rows, numbers=True), errors))


def _columns(entries: Sequence[Dict[str, Any]]) -> Tuple[List[Tuple[str, str]], List[Dict[str, Any]]]:
    """The table's columns (title, ledger key) and the ledger lines as it shows them: an evaluator sweep's metrics
    (each with its standard error), else the row columns with rows/s (and mean sum when scoring)."""
    names = metric_names(entries)
    if names:
        columns = [("checkpoint", "checkpoint"), *((name, name) for name in names), ("seconds", "seconds")]
        return columns, [dict(entry, **_with_stderr(entry.get("metrics") or {}, names)) for entry in entries]
    scoring = any(entry.get("mean_sum") is not None for entry in entries)
    columns = [column for column in COLUMNS if column[1] != "mean_sum" or scoring]
    return columns, [dict(entry, rows_per_second=_rate(entry)) for entry in entries]


def _rate(entry: Dict[str, Any]) -> Optional[float]:
    """Rows per second of a ledger line (None without its seconds)."""
    seconds = entry.get("seconds") or 0.0
    return entry.get("rows", 0) / seconds if seconds else None


def metric_names(entries: Sequence[Dict[str, Any]]) -> List[str]:
    """The evaluator metrics of the ledger lines, in the order they first appear (none for a sampling sweep).

    A standard error that lm-eval reports beside its metric (``task/acc_stderr,none`` beside ``task/acc,none``) is
    no metric of its own here: the table and the plot show it with its metric (``sweep.jsonl`` keeps every number).
    """
    names: Dict[str, None] = {}
    for entry in entries:
        metrics = entry.get("metrics")
        if isinstance(metrics, dict):
            names.update(dict.fromkeys(str(name) for name in metrics))
    errors = {stderr_of(name) for name in names}
    return [name for name in names if name not in errors]


def stderr_of(name: str) -> str:
    """The key of a metric's standard error in lm-eval's words: ``task/acc,none`` -> ``task/acc_stderr,none``."""
    head, comma, filter_name = name.partition(",")
    return f"{head}_stderr{comma}{filter_name}"


def _short(checkpoint: str) -> str:
    return printable(checkpoint.rstrip("/").rsplit("/", 1)[-1])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _with_stderr(metrics: Dict[str, Any], names: Sequence[str]) -> Dict[str, Any]:
    """The metrics as the table shows them: a metric with its standard error as ``0.412±0.011``."""
    shown: Dict[str, Any] = {}
    for name in names:
        value, error = metrics.get(name), metrics.get(stderr_of(name))
        both = isinstance(value, float) and isinstance(error, float)
        shown[name] = f"{_cell(value)}±{_cell(error)}" if both else value
    return shown


def plot_panels(entries: Sequence[Dict[str, Any]]) -> List[Tuple[str, str]]:
    """Return the plot's panels, ``(ledger key, label)``, for the finished checkpoints' ledger lines."""
    names = metric_names(entries)
    if names:
        return [(name, name) for name in names]
    if any(entry.get("mean_sum") is not None for entry in entries):  # scoring: the length is the input's, constant
        return [("mean_sum", "held-out mean sum (logprob per line)"), ("mean_logprob", "mean logprob per token")]
    return [("mean_logprob", "mean logprob"), ("mean_length", "mean length")]


def draw_plot(entries: Sequence[Dict[str, Any]], path: str) -> None:
    """Draw the per-checkpoint values against the step into ``path`` (matplotlib, no display).

    A sampling sweep draws mean logprob and mean length; a scoring sweep the held-out mean sum (logprob per line)
    and the mean logprob per token (its lengths are the input's, the same for every checkpoint); an evaluator sweep
    one panel per metric, with its standard error as error bars where lm-eval reports one, three panels a row past
    six, and at most ``MAX_PLOT_PANELS`` (the title says how many were left out; ``sweep.jsonl`` has them all).
    """
    check_plot_dependency()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot

    steps, done = _plotted(entries)
    panels = plot_panels(done)
    shown = panels[:MAX_PLOT_PANELS]
    columns = 1 if len(shown) <= 6 else 3
    rows = -(-len(shown) // columns)
    figure, axes = pyplot.subplots(rows, columns, sharex=True, figsize=(7 * columns, 2.5 * rows), squeeze=False)
    for index, axis in enumerate(axes.flat):
        if index < len(shown):
            _draw_panel(axis, steps, done, *shown[index])
        else:
            axis.set_visible(False)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    title = "per-checkpoint metrics" if metric_names(done) else "per-checkpoint means"
    if len(shown) < len(panels):
        title += f": the first {len(shown)} of {len(panels)} (every number is in sweep.jsonl)"
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def _plotted(entries: Sequence[Dict[str, Any]]) -> Tuple[List[Any], List[Dict[str, Any]]]:
    """The finished checkpoints' steps (their place without one) and ledger lines, an evaluator's metrics spread in."""
    done = [entry for entry in entries if "error" not in entry]
    steps = [entry.get("step") if entry.get("step") is not None else index for index, entry in enumerate(done)]
    if metric_names(done):
        done = [dict(entry, **(entry.get("metrics") or {})) for entry in done]
    return steps, done


def _draw_panel(axis: Any, steps: Sequence[Any], done: Sequence[Dict[str, Any]], key: str, label: str) -> None:
    """Draw one value against the step, with its standard error as error bars where the ledger has one."""
    points = [
        (step, entry[key], entry.get(stderr_of(key))) for step, entry in zip(steps, done) if entry.get(key) is not None
    ]
    errors = [error if isinstance(error, float) else 0.0 for _, _, error in points]
    x, y = [p[0] for p in points], [p[1] for p in points]
    axis.errorbar(x, y, yerr=errors if any(errors) else None, marker="o", capsize=3)
    axis.set_ylabel(label)
    axis.grid(True, alpha=0.3)
