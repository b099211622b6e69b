"""Batch evaluation: JSONL in, JSONL out, resumable, with memory flat whatever the input size.

Owns input parsing (one ``InputLine`` per line), the resume set (ids only), torn-line repair and the atomic
rewrite of the output, and result records. No HTTP and no threads (``_batch_job`` runs the lines through the
client), no argparse, tqdm or signals (``cli``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any, Dict, Iterable, Iterator, Optional, Set, Tuple, Union

from lora_sampler.errors import (
    BatchInputError,
    EngineStatusError,
)
from lora_sampler.types import AdapterSpec, SampleOutput, SampleRequest, SamplingParams

logger = logging.getLogger(__name__)

#: Per-line keys that override the sampling defaults.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")

LineId = Union[str, int]


def id_key(line_id: LineId) -> str:
    """Return the resume-set key of an id (``5`` and ``"5"`` are different ids)."""
    return json.dumps(line_id)


@dataclass(frozen=True)
class LineDefaults:
    """What every input line gets unless it says otherwise (the CLI flags)."""

    adapter: Optional[AdapterSpec] = None
    base_model: Optional[str] = None
    num_samples: int = 1
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line: a request to send, or the reason it cannot be sent (``error``)."""

    line_number: int
    id: LineId
    request: Optional[SampleRequest] = None
    error: str = ""

    @property
    def key(self) -> str:
        """The resume-set key of this line's id."""
        return id_key(self.id)


def parse_line(raw: bytes, line_number: int, defaults: LineDefaults) -> Optional[InputLine]:
    """Parse one JSONL input line; None for a blank line. Never raises for bad content: see ``InputLine.error``."""
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        return InputLine(line_number, line_number, error=f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return InputLine(line_number, line_number, error=f"a JSON object is needed, got a {type(obj).__name__}")
    line_id = obj.get("id", line_number)
    if isinstance(line_id, bool) or not isinstance(line_id, (str, int)):
        return InputLine(line_number, line_number, error=f"id must be a string or an integer, got {line_id!r}")
    if "prompt" not in obj:
        return InputLine(line_number, line_id, error="the line has no 'prompt' (token ids or text)")
    try:
        overrides = {key: obj[key] for key in SAMPLING_KEYS if key in obj}
        params = defaults.sampling_params
        if overrides:
            params = SamplingParams(**{**_fields(params), **overrides})
        request = SampleRequest(
            obj["prompt"],
            adapter=defaults.adapter,
            base_model=defaults.base_model,
            num_samples=obj.get("num_samples", defaults.num_samples),
            sampling_params=params,
            prompt_logprobs=bool(obj.get("prompt_logprobs", defaults.prompt_logprobs)),
            session_id=obj.get("session_id"),
        )
    except (TypeError, ValueError) as exc:
        return InputLine(line_number, line_id, error=str(exc))
    return InputLine(line_number, line_id, request)


def _fields(params: SamplingParams) -> Dict[str, Any]:
    return {name: getattr(params, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")}


def read_input(stream: IO[bytes], defaults: LineDefaults, *, name: str = "<input>") -> Iterator[InputLine]:
    """Yield the non-blank lines of a JSONL stream, one at a time.

    Raises:
        BatchInputError: an id repeats an earlier line's id (the message names both line numbers).
    """
    first_line: Dict[str, int] = {}  # ids only, so memory stays small however long the input
    for number, raw in enumerate(stream, 1):
        line = parse_line(raw, number, defaults)
        if line is None:
            continue
        first = first_line.setdefault(line.key, number)
        if first != number:
            raise BatchInputError(
                f"{name}: line {number} repeats the id {line.id!r} of line {first}; give every line a unique id "
                "(or none: the line number is used), then run again with the same --output to resume",
                path=name,
                line_number=number,
            )
        yield line


def count_lines(path: str) -> int:
    """Count the lines of a file without parsing them (for the progress bar's total)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


# -- resume ------------------------------------------------------------------------------------------------------


@dataclass
class ResumeState:
    """What an existing output file already holds.

    Attributes:
        done: Keys of ids not to run again (answered, or failed when failures are not retried).
        kept_errors: Error lines kept (``retry_failed=False``); they make the job's exit status non-zero.
        dropped_errors: Error lines dropped so their ids run again.
        dropped_torn: Torn or unreadable lines dropped (a kill mid-write leaves at most one).
        rewritten: Whether the file was rewritten (atomically).
    """

    done: Set[str] = field(default_factory=set)
    kept_errors: int = 0
    dropped_errors: int = 0
    dropped_torn: int = 0
    rewritten: bool = False


def _scan(lines: Iterable[bytes], retry_failed: bool, state: ResumeState) -> Iterator[Tuple[bytes, bool]]:
    """Yield ``(line, keep)`` for each output line; fill ``state`` (the one decision both passes share)."""
    for raw in lines:
        record: Any = None
        if raw.endswith(b"\n"):  # a last line without its newline was torn by a kill
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:
                record = None
        if (
            not isinstance(record, dict)
            or isinstance(record.get("id"), bool)
            or not isinstance(record.get("id"), (str, int))
        ):
            state.dropped_torn += 1
            yield raw, False
            continue
        key, failed = id_key(record["id"]), "error" in record
        keep = key not in state.done and not (failed and retry_failed)
        if keep:
            state.done.add(key)
            state.kept_errors += failed
        elif failed and retry_failed:
            state.dropped_errors += 1
        yield raw, keep


def prepare_output(path: str, *, retry_failed: bool = True) -> ResumeState:
    """Read an existing output file into a resume set, dropping torn lines and (by default) error lines.

    The file is read twice, streaming (only ids are kept in memory). When lines must go, the kept ones are copied
    to a temporary file beside it, fsynced, and moved over it with ``os.replace``, so a crash leaves the old file or
    the new one, never a mix. Duplicate ids keep their first line.

    Args:
        path: The output file; a missing file gives an empty state.
        retry_failed: Drop error lines, so their ids run again.
    """
    state = ResumeState()
    if not os.path.exists(path):
        return state
    with open(path, "rb") as f:
        needs_rewrite = sum(not keep for _, keep in _scan(f, retry_failed, state)) > 0  # reads every line
    if not needs_rewrite:
        return state
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, open(path, "rb") as f:
            for raw, keep in _scan(f, retry_failed, ResumeState()):
                if keep:
                    out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(path, temp)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    state.rewritten = True
    return state


# -- records -----------------------------------------------------------------------------------------------------


def _number(value: Optional[float]) -> Optional[float]:
    return None if value is None or math.isnan(value) else value  # NaN is not JSON


def result_record(line: InputLine, output: SampleOutput) -> Dict[str, Any]:
    """Return the output record of an answered line."""
    record: Dict[str, Any] = {
        "id": line.id,
        "model": output.model,
        "sequences": [
            {
                "tokens": list(s.tokens),
                "logprobs": [_number(lp) for lp in s.logprobs],
                "text": s.text,
                "stop_reason": s.stop_reason,
            }
            for s in output.sequences
        ],
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [_number(lp) for lp in output.prompt_logprobs]
    return record


def error_record(line: InputLine, error: Union[BaseException, str], model: Optional[str] = None) -> Dict[str, Any]:
    """Return the output record of a failed line: the status (None without one), the error type and its message."""
    if isinstance(error, str):
        status, kind, message = None, "BatchInputError", f"line {line.line_number}: {error}"
    else:
        status = error.status if isinstance(error, EngineStatusError) else None
        kind, message = type(error).__name__, str(error) or repr(error)
    body: Dict[str, Any] = {"status": status, "type": kind, "message": message, "line": line.line_number}
    record: Dict[str, Any] = {"id": line.id}
    if model:
        record["model"] = model
    record["error"] = body
    return record


def write_record(stream: IO[str], record: Dict[str, Any]) -> None:
    """Write one record as one complete line, and flush it."""
    stream.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    stream.flush()
