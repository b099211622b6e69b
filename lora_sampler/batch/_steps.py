"""What a sweep does with one checkpoint's lines: ``SampleStep`` here, and its subclass ``_score.ScoreStep``.

A step turns the sweep's input into one checkpoint's request lines, names the output's record format, and reads a
finished output file back into the checkpoint's ledger fields. The scheduler (``_sweep``) knows nothing else about
the lines, so scoring is the same step with its own records and summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Generator, Iterator, Mapping, Optional, Sequence, Union

from lora_sampler.batch._lines import PROMPT_LINES, InputLine, LineDefaults, LineFormat, LineParser, read_input
from lora_sampler.errors import BatchInputError
from lora_sampler.types import Adapter, SampleRequest, ScoreRequest

#: The sweep's input: a JSONL file of prompt or messages lines, or the lines themselves (mappings with the
#: keys of such a line, or ``SampleRequest`` (``ScoreRequest`` to score) values, whose ids are their 1-based positions).
SweepInput = Union[str, "os.PathLike[str]", Sequence[Union[Mapping[str, Any], SampleRequest, ScoreRequest]]]


class SampleStep:
    """Sample every input line from the checkpoint's adapter, in ``sample``'s record format: one checkpoint's
    evaluation, as the sweep scheduler drives it (its lines, its records, the summary of its output).

    Args:
        source: The input (``SweepInput``); a file is read again for each checkpoint, so memory stays flat.
        defaults: What every line gets unless it says otherwise (its ``adapter`` is replaced per checkpoint).
    """

    #: The input's lines and the output's records (how a line becomes a request, what ``BatchJob`` writes and
    #: resume reads).
    line_format: LineFormat = PROMPT_LINES

    def __init__(self, source: SweepInput, defaults: Optional[LineDefaults] = None):
        if isinstance(source, (str, os.PathLike)):
            self._path: Optional[str] = os.fspath(source)
            self._items: Sequence[Union[Mapping[str, Any], SampleRequest, ScoreRequest]] = ()
        elif isinstance(source, Sequence):
            self._path, self._items = None, source  # type: ignore[assignment]  # str was taken above
        else:
            raise TypeError(
                f"the sweep's input must be a JSONL path or a sequence of lines, got {type(source).__name__}"
            )
        self._defaults = defaults or LineDefaults()

    def lines(self, adapter: Adapter) -> Generator[InputLine, None, None]:
        """Yield the input lines aimed at ``adapter`` (read afresh each time).

        Raises:
            BatchInputError: an id repeats an earlier line's (as ``read_input``).
        """
        defaults = dataclasses.replace(self._defaults, adapter=adapter, base_model=None)
        if self._path is not None:
            with open(self._path, "rb") as handle:
                yield from read_input(handle, defaults, name=self._path, parse=self.line_format.parse)
            return
        seen: Dict[str, int] = {}
        for number, item in enumerate(self._items, 1):
            line = _item_line(item, number, defaults, adapter, self.line_format.parse)
            first = seen.setdefault(line.key, number)
            if first != number:
                raise BatchInputError(
                    f"requests[{number - 1}] repeats the id {line.id!r} of requests[{first - 1}]; give every line a "
                    "unique id (or none: its position is used)"
                )
            yield line

    def settings(self, adapter: Union[Adapter, str]) -> Dict[str, Any]:
        """Return the settings that change ``adapter``'s answers: the records' kind and the lines' defaults."""
        return self.line_format.settings(self._defaults, adapter)

    def summary(self, output_path: str) -> Dict[str, Any]:
        """``rows``, ``failed``, ``tokens`` (generated), ``mean_logprob`` (per generated token) and ``mean_length``
        (generated tokens per sequence) of an output file."""
        counts = {"rows": 0, "failed": 0}
        tokens = sequences = counted = 0
        total = 0.0
        for record in answered_records(output_path, counts):
            for sequence in record.get("sequences", ()):
                sequences += 1
                tokens += len(sequence.get("tokens", ()))
                values = [lp for lp in sequence.get("logprobs", ()) if lp is not None]
                total += sum(values)
                counted += len(values)
        return {
            **counts,
            "tokens": tokens,
            "mean_logprob": total / counted if counted else None,
            "mean_length": tokens / sequences if sequences else None,
        }


def _item_line(item: Any, number: int, defaults: LineDefaults, adapter: Adapter, parse: LineParser) -> InputLine:
    """The input line of one item of a sequence input: a request value (id: its position) or a line mapping."""
    if isinstance(item, (SampleRequest, ScoreRequest)):
        return InputLine(number, number, dataclasses.replace(item, adapter=adapter, base_model=None))
    if not isinstance(item, Mapping):
        raise TypeError(f"requests must hold mappings or request values, got {type(item).__name__}")
    line = parse(json.dumps(dict(item)).encode("utf-8"), number, defaults)
    return line if line is not None else InputLine(number, None, error="an empty line")


def answered_records(path: str, counts: Dict[str, int]) -> Iterator[Dict[str, Any]]:
    """Yield the answered records of an output file, counting every record in ``rows`` and errors in ``failed``."""
    with open(path, "rb") as handle:
        for raw in handle:
            record = json.loads(raw)
            counts["rows"] += 1
            if "error" in record:
                counts["failed"] += 1
                continue
            yield record
