"""A sweep's summary table and ``--plot`` for an evaluator with many metrics, as lm-eval's task groups report."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lora_sampler.cli._sweep_runner import MAX_PLOT_PANELS, draw_plot, metric_names, summary_table


def _entries(tasks: int) -> List[Dict[str, Any]]:
    """Three checkpoints' ledger lines with an ``acc`` and its ``acc_stderr`` per task, in lm-eval's keys."""
    entries = []
    for step in (100, 200, 300):
        metrics: Dict[str, Any] = {}
        for task in range(tasks):
            metrics[f"task{task}/acc,none"] = 0.25 + step / 1000 + task / 10_000
            metrics[f"task{task}/acc_stderr,none"] = 0.01
        metrics["lone/acc_stderr,none"] = "N/A"  # a standard error without its metric stays a number of its own
        entries.append({"checkpoint": f"runs/step-{step}", "step": step, "metrics": metrics, "seconds": 1.0})
    return entries


def _png_size(path: Path) -> tuple:
    """(width, height) in pixels, from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_a_standard_error_is_shown_with_its_metric_not_as_one_of_its_own() -> None:
    """The table shows ``acc`` as value±stderr; the stderr gets no column (sweep.jsonl keeps every number)."""
    entries = _entries(2)
    assert metric_names(entries) == ["task0/acc,none", "task1/acc,none", "lone/acc_stderr,none"]
    header, first = summary_table(entries).splitlines()[:2]
    assert "acc_stderr" not in header.replace("lone/acc_stderr,none", "")
    assert "0.350±0.010" in first and "N/A" in first


def test_plot_of_a_task_group_with_hundreds_of_numbers_is_drawn_and_bounded(tmp_path: Path) -> None:
    """150 tasks (300 numbers with their standard errors): the plot draws the first 60 metrics, three a row.

    Before, one 2.5-inch panel per number, standard errors included: a strip of 301 panels, 700 x 75,250 pixels
    (4 MB), no panel readable.
    """
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.png"
    draw_plot(_entries(150), str(path))
    width, height = _png_size(path)
    rows = MAX_PLOT_PANELS // 3
    assert width == 3 * 7 * 100 and height == rows * 250  # three columns of 7 in, rows of 2.5 in, at 100 dpi


def test_plot_of_a_few_metrics_keeps_one_column(tmp_path: Path) -> None:
    """Up to six panels stay one column, as before."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.png"
    draw_plot(_entries(2), str(path))
    assert _png_size(path) == (700, 3 * 250)  # task0, task1 and the lone stderr
