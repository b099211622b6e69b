"""The one progress bar (``ProgressBar``) of the fan-out, the sweep and the command line, counted from any thread."""

from __future__ import annotations

import io
import sys
import threading
from typing import Any, List

from lora_sampler._client.outage import OutageEvent
from lora_sampler._client.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _on_a_terminal(monkeypatch: Any) -> _Terminal:
    """stderr as a terminal (set in the test itself: pytest's capture sets sys.stderr again after fixtures)."""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def _last_state(stream: io.StringIO) -> str:
    return stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]


def test_rows_counted_from_many_threads_add_up(monkeypatch: Any) -> None:
    """A sweep's checkpoints report rows from their own threads: the bar counts every one, failures included."""
    terminal = _on_a_terminal(monkeypatch)
    retries: List[int] = [0]
    bar = ProgressBar(800, lambda: retries[0], unit="line", terminal=True)
    start = threading.Barrier(8)

    def report(worker: int) -> None:
        start.wait()
        for row in range(100):
            bar.count_row("failed" if row % 10 == 0 else "done", f"boom {worker}" if row % 10 == 0 else "", "boom")

    threads = [threading.Thread(target=report, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    retries[0] = 3
    bar.close()
    out = terminal.getvalue()
    assert "800/800" in _last_state(terminal) and "failed=80" in _last_state(terminal) and "retries=3" in out
    assert out.count("lora-sampler: boom") == 1 and "80 lines failed with the same error as boom" in out


def test_skipped_rows_count_only_towards_a_total(monkeypatch: Any) -> None:
    """Resumed rows fill a bar whose total counts every line; a bar without a total counts only rows that ran."""
    _on_a_terminal(monkeypatch)
    with_total, without = (ProgressBar(t, lambda: 0, unit="line", terminal=True) for t in (2, None))
    for bar in (with_total, without):
        bar.count_row("skipped")
        bar.count_row("done")
    assert with_total.bar.n == 2 and without.bar.n == 1
    with_total.close()
    without.close()


def test_an_outage_shows_on_the_bar_until_the_engine_is_back(monkeypatch: Any) -> None:
    terminal = _on_a_terminal(monkeypatch)
    bar = ProgressBar(None, lambda: 0, unit="line", terminal=True)
    bar.on_outage(OutageEvent("waiting", since=0.0, waited=12.0, max_outage=60.0, held=2, error=OSError("down")))
    assert "engine=away 12/60 s" in _last_state(terminal)
    bar.on_outage(OutageEvent("back", since=0.0, waited=15.0, max_outage=60.0, held=0, error=OSError("down")))
    assert "engine" not in _last_state(terminal)
    bar.close()


def test_no_terminal_or_quiet_draws_nothing_and_still_prints_failures(capsys: Any) -> None:
    """stderr not a terminal (or --quiet): no bar, the first of each error still printed, the count at the end."""
    for quiet in (False, True):
        bar = ProgressBar(3, lambda: 0, unit="line", terminal=True, quiet=quiet)
        assert bar.bar is None
        bar.count_row("failed", "line 1 refused", "refused")
        bar.count_row("failed", "line 2 refused", "refused")
        bar.close()
        assert capsys.readouterr().err.splitlines() == [
            "lora-sampler: line 1 refused",
            "lora-sampler: 2 lines failed with the same error as line 1 refused",
        ]


def test_a_log_line_while_the_bar_is_drawn_is_written_above_it_whole(monkeypatch: Any) -> None:
    """The command line's log lines (``logs_to_stderr``) go through tqdm's own write while a bar is drawn: the bar
    is cleared, the line written on a line of its own, the bar drawn again below it (never a line cut into the bar)."""
    import logging

    from tqdm import tqdm

    from lora_sampler.cli._terminal import logs_to_stderr

    terminal = _on_a_terminal(monkeypatch)
    written: List[str] = []
    real_write = tqdm.write

    def write(line: str, **more: Any) -> None:
        written.append(line)
        real_write(line, **more)

    monkeypatch.setattr(tqdm, "write", write)
    bar = ProgressBar(4, lambda: 0, unit="line", terminal=True)
    bar.count_row("done")
    with logs_to_stderr("INFO"):
        logging.getLogger("lora_sampler.test").info("retrying after a 503")
    bar.count_row("done")
    bar.close()
    assert written == ["INFO lora_sampler.test: retrying after a 503"]
    assert "INFO lora_sampler.test: retrying after a 503" in terminal.getvalue().replace("\r", "\n").splitlines()
    assert "2/4" in _last_state(terminal)
