"""The one progress bar: of ``SamplerClient``'s fan-out (``progress=True``), of a sweep, and of a command-line job.

It shows done/total, the rate, retries (since it started), failures and, during an outage, how long the engine has
been away. In Python ``tqdm.auto`` picks the bar: a notebook widget in Jupyter (one output, updated in place; it
needs ipywidgets, the ``notebook`` extra), text on a terminal. On the command line the bar is drawn on stderr when
it is a terminal, and a failed line's error is printed above it (once per distinct error). tqdm is the optional
``cli`` extra, imported only when a bar is asked for.
"""

from __future__ import annotations

import operator
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from lora_sampler._client.outage import OutageEvent

#: Characters of an error message repeated in the count line at the end.
_SHORT_MESSAGE = 160


class ProgressBar:
    """One bar over the outcomes of a fan-out, a sweep or a command-line job (see the module docstring).

    Steps are counted from any thread (a sweep's checkpoints report from theirs).

    Args:
        total: The number of steps, or None (unknown: the bar counts without a total); a caller's ``total=`` is
            checked by the caller (``SamplerClient``'s fan-outs).
        retries: Reads the client's retry count.
        unit: What one step is (``"req"``, ``"line"``).
        terminal: The command line's bar: drawn on stderr only when it is a terminal and tqdm is installed (else
            nothing is drawn, and failures are still printed). False: ``tqdm.auto``, and tqdm is required.
        quiet: Draw no bar (``--quiet``); failures are still printed.
    """

    def __init__(
        self,
        total: Optional[int],
        retries: Callable[[], int],
        *,
        unit: str = "req",
        terminal: bool = False,
        quiet: bool = False,
    ) -> None:
        self.bar = None if quiet else _tqdm(total, unit, terminal)
        self._has_total = total is not None
        self._retries, self._first = retries, retries()
        self._failed = 0
        self._lock = threading.Lock()
        #: Each distinct error's first message and how many lines failed with it, in the order first seen.
        self._errors: Dict[str, List[Any]] = {}
        self._show()

    @classmethod
    def over(cls, requests: Iterable[Any], retries: Callable[[], int], total: Optional[int] = None) -> ProgressBar:
        """The bar of a fan-out over ``requests``: its total is ``total``, else their length when they have one."""
        if total is None:
            hint = operator.length_hint(requests, -1)
            total = None if hint < 0 else hint
        return cls(total, retries)

    def update(self, outcome: Any) -> None:
        """Count one outcome of a fan-out (an exception counts as a failure)."""
        self.count_row("failed" if isinstance(outcome, BaseException) else "done")

    def count_row(self, kind: str, error: str = "", same_as: str = "") -> None:
        """Count one row of a batch job by its kind: ``"done"``, ``"failed"``, or ``"skipped"`` (resumed).

        A skipped row is counted only on a bar with a total (which counts every line, resumed ones too). A failed
        row's ``error`` is printed above the bar the first time an error that reads as ``same_as`` (default: the
        message itself) is seen; the same error on other rows is counted, and ``close`` prints the count once (29
        lines failing during an outage make two lines, not 29).
        """
        if kind == "skipped" and not self._has_total:
            return
        with self._lock:
            self._failed += kind == "failed"
            if error:
                seen = self._errors.setdefault(same_as or error, [error, 0])
                seen[1] += 1
                if seen[1] == 1:
                    self.say(f"lora-sampler: {error}")
            if self.bar is not None:
                self._show()
                self.bar.update(1)

    def on_outage(self, event: OutageEvent) -> None:
        """Show how long the engine has been away (an ``on_outage`` hook, called from worker threads)."""
        if self.bar is not None:
            self._show(
                **({"engine": f"away {event.waited:.0f}/{event.max_outage:g} s"} if event.kind != "back" else {})
            )
            self.bar.refresh()

    def say(self, message: str) -> None:
        """Print a line on stderr, above the bar when there is one (``say_above_bars``)."""
        say_above_bars(message)

    def close(self) -> None:
        """Say how many rows failed with each error seen more than once; draw the final state and release the bar."""
        errors, self._errors = self._errors, {}
        for message, count in errors.values():
            if count > 1:
                self.say(f"lora-sampler: {count} lines failed with the same error as {_shortened(message)}")
        if self.bar is not None:
            self._show()
            self.bar.close()

    def _show(self, **extra: Any) -> None:
        if self.bar is not None:
            retries = self._retries() - self._first
            self.bar.set_postfix(retries=retries, failed=self._failed, **extra, refresh=False)


def say_above_bars(message: str) -> None:
    """Print a line on stderr above every bar this process draws (tqdm's own write: it clears them, writes, redraws).

    For lines that do not know the bar, such as the command line's log lines; without tqdm, a plain print.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        print(message, file=sys.stderr)
    else:
        tqdm.write(message, file=sys.stderr)


def _tqdm(total: Optional[int], unit: str, terminal: bool) -> Any:
    """The bar: on the command line (``terminal``) tqdm's text bar on stderr, only when it is a terminal and tqdm is
    installed (else None); in Python ``tqdm.auto``'s, and tqdm is required."""
    if terminal and not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
        from tqdm.auto import tqdm as auto_tqdm
    except ImportError:
        if terminal:
            return None
        raise ImportError("progress=True needs tqdm: pip install 'lora_sampler[cli]'") from None
    if terminal:
        return tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)
    return auto_tqdm(total=total, unit=unit, dynamic_ncols=True)


def _shortened(message: str) -> str:
    return message if len(message) <= _SHORT_MESSAGE else message[: _SHORT_MESSAGE - 3] + "..."
