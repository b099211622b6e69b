"""Batch evaluation: JSONL in, JSONL out, resumable, with memory flat whatever the input size.

Owns input parsing (one ``InputLine`` per line), the resume set (ids only), torn-line repair and the atomic
rewrite of the output, what an output remembers of how its answers were made (``<output>.settings``), and result
records. No HTTP, no threads, no argparse, tqdm or signals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

from lora_sampler._files import HAS_FLOCK, TEMP_SUFFIX, json_object_line, replacing, temp_prefix, try_flock
from lora_sampler._views import json_number
from lora_sampler._wire.messages import SAMPLING_FIELDS, text_problem
from lora_sampler.errors import (
    BatchInputError,
    EngineStatusError,
    LoraSamplerError,
    OutputClosedError,
    OutputSettingsError,
    OutputWriteError,
)
from lora_sampler.types import Adapter, AdapterSpec, SampleOutput, SampleRequest, SamplingParams, ScoreRequest

logger = logging.getLogger(__name__)

#: Per-line keys that override the sampling defaults.
SAMPLING_KEYS = (*SAMPLING_FIELDS, "stop")
#: The key of a line holding the user's own data (any JSON value): not sent, copied to the line's output row.
METADATA_KEY = "metadata"
#: Every key a prompt line may hold.
LINE_KEYS = (
    "id",
    "prompt",
    "messages",
    "num_samples",
    *SAMPLING_KEYS,
    "session_id",
    "prompt_logprobs",
    "extra_body",
    METADATA_KEY,
)
#: Keys other tools spell another way in a line, and what a line holds instead.
LINE_HABITS = {
    "n": "num_samples (the OpenAI API's n)",
    "max_new_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop_token_ids": "stop (token ids and strings alike)",
    "model": "--adapter or --base-model (a prompt line samples the run's model; OpenAI batch lines name theirs in "
    "body.model)",
}

LineId = Union[str, int]
#: The UTF-8 byte order mark some editors (and PowerShell's ``Out-File``) write at the start of a file.
UTF8_BOM = b"\xef\xbb\xbf"


#: JSON's whitespace (RFC 8259): a line of only these is blank; ``bytes.strip`` also strips \x0b and \x0c.
JSON_WHITESPACE = b" \t\r\n"
#: The byte order marks of UTF-16 (PowerShell 5's ``>`` writes UTF-16 LE with one).
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def is_blank(raw: bytes) -> bool:
    """Tell whether a raw line holds only JSON whitespace (a line of form feeds is not blank: it is bad JSON)."""
    return not raw.strip(JSON_WHITESPACE)


def loads_line(raw: bytes) -> Any:
    """Decode one UTF-8 JSON line.

    Raises:
        ValueError: it is not UTF-8 or not JSON (the message says which), or it is nested too deep to decode.
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("it is nested too deep to decode") from None


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
    #: Further body fields of every request (``--extra-body``); a line's own ``extra_body`` object overrides its keys.
    extra_body: Optional[Mapping[str, Any]] = None
    #: Whether an OpenAI batch line's ``body.model`` may name a local checkpoint (else it must be a name).
    allow_model_paths: bool = False
    #: Names the engine serves as base models: an OpenAI batch line's ``body.model`` among them samples that base
    #: model (with no adapter or base model above, which override ``body.model``).
    base_models: Sequence[str] = ()


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line: a request to send, or the reason it cannot be sent (``error``)."""

    line_number: int
    id: Optional[LineId]
    request: Union[SampleRequest, ScoreRequest, None] = None
    error: str = ""
    #: The line's own ``metadata`` (any JSON value), copied to its output row; None without.
    metadata: Any = None

    @property
    def key(self) -> str:
        """The resume-set key of this line's id; a line whose id cannot be read (it is not JSON) is keyed by its
        line number in a form no id's key takes (``#line5``), so it never collides with the id ``5``."""
        return id_key(self.id) if self.id is not None else f"#line{self.line_number}"


#: Builds the request of one line object from it and the defaults; raises ``ValueError`` (or ``TypeError``) naming what
#: is wrong, which becomes the line's error.
LineRequest = Callable[[Dict[str, Any], LineDefaults], Union[SampleRequest, ScoreRequest]]
#: Reads the id of one line object (``(object, line number)``); raises ``ValueError`` naming what is wrong with it.
LineIdOf = Callable[[Dict[str, Any], int], LineId]


def line_id(obj: Mapping[str, Any], line_number: int) -> LineId:
    """Return a prompt or scoring line's ``id``: a string or an integer, the line number when it has none.

    Raises:
        ValueError: the id is of another type, or it is no text (a lone surrogate).
    """
    found = obj.get("id", line_number)
    if isinstance(found, bool) or not isinstance(found, (str, int)):
        raise ValueError(f"id must be a string or an integer, got {found!r}")
    if isinstance(found, str) and text_problem(found):
        raise ValueError(f"the id {text_problem(found)}; give the line a text id")
    return found


def parse_object_line(
    raw: bytes, line_number: int, defaults: LineDefaults, request_of: LineRequest, id_of: LineIdOf = line_id
) -> Optional[InputLine]:
    """Parse one line of a format of one JSON object a line (prompt lines, scoring lines, OpenAI batch lines).

    Never raises for bad content. None for a blank line; a line that is not a JSON object, or whose id ``id_of``
    refuses, is its error (with no id); else the line with ``request_of``'s request, or the error it raised,
    carrying the object's ``metadata`` (copied to its output row) when it has one.
    """
    if is_blank(raw):
        return None
    try:
        obj = loads_line(raw)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        return InputLine(line_number, None, error=f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return InputLine(line_number, None, error=f"a JSON object is needed, got a {type(obj).__name__}")
    try:
        found = id_of(obj, line_number)
    except ValueError as exc:
        return InputLine(line_number, None, error=str(exc))
    try:
        request = request_of(obj, defaults)
    except (TypeError, ValueError) as exc:
        return InputLine(line_number, found, error=str(exc), metadata=obj.get(METADATA_KEY))
    return InputLine(line_number, found, request, metadata=obj.get(METADATA_KEY))


def check_keys(obj: Mapping[str, Any], known: Sequence[str], habits: Mapping[str, str], own: str = "") -> None:
    """Refuse the first key of ``obj`` not in ``known``, saying what to write instead.

    Args:
        obj: The line (or a part of it).
        known: The keys it may hold.
        habits: Keys other tools use, and this format's spelling of each.
        own: Where the user's own fields go, when the format has such a place (``metadata``).

    Raises:
        ValueError: ``obj`` holds such a key (the message names it).
    """
    unknown = sorted(set(obj) - set(known))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, known, n=1)
    if name in habits:
        fix = f"use {habits[name]}"
    elif close:
        fix = f"did you mean {close[0]!r}?"
    else:
        fix = f"a line holds {', '.join(known)}"
    where = f"; put your own fields in {own!r}" if own else ""
    raise ValueError(f"unknown key {name!r} ({fix}){where}")


def parse_line(raw: bytes, line_number: int, defaults: LineDefaults) -> Optional[InputLine]:
    """Parse one JSONL input line; None for a blank line. Never raises for bad content: see ``InputLine.error``."""
    return parse_object_line(raw, line_number, defaults, _line_request)


def _line_request(obj: Dict[str, Any], defaults: LineDefaults) -> SampleRequest:
    """The request of a prompt-line object (a ``ValueError`` or ``TypeError`` naming what is wrong)."""
    check_keys(obj, LINE_KEYS, LINE_HABITS, own=METADATA_KEY)
    prompt_logprobs = obj.get("prompt_logprobs", defaults.prompt_logprobs and "messages" not in obj)
    if not isinstance(prompt_logprobs, bool):
        raise ValueError(f"prompt_logprobs must be true or false, got {prompt_logprobs!r}")
    if "prompt" not in obj and "messages" not in obj:
        raise ValueError("the line has no 'prompt' (token ids or text) and no 'messages' (chat)")
    overrides = {key: obj[key] for key in SAMPLING_KEYS if key in obj}
    params = defaults.sampling_params
    if overrides:
        params = SamplingParams(**{**dataclasses.asdict(params), **overrides})  # its fields are SAMPLING_KEYS
    return SampleRequest(
        obj.get("prompt"),
        messages=obj.get("messages"),
        adapter=defaults.adapter,
        base_model=defaults.base_model,
        num_samples=obj.get("num_samples", defaults.num_samples),
        sampling_params=params,
        # --prompt-logprobs applies to prompt lines; a chat line asking for them itself is refused.
        prompt_logprobs=prompt_logprobs,
        session_id=obj.get("session_id"),
        extra_body=_extra_body(defaults.extra_body, obj.get("extra_body")),
    )


def _extra_body(defaults: Optional[Mapping[str, Any]], own: object) -> Optional[Mapping[str, Any]]:
    """A line's extra body fields: the defaults (``--extra-body``) with the line's own ``extra_body`` over them."""
    if own is None:
        return defaults
    if not isinstance(own, Mapping):
        raise TypeError(f"extra_body must be an object of body fields, got {own!r}")
    return {**(defaults or {}), **own}


#: Parses one raw input line (``parse_line``'s signature): the plain format, or ``openai_batch.parse_batch_line``.
LineParser = Callable[[bytes, int, LineDefaults], Optional[InputLine]]


def read_input(
    stream: Iterable[bytes], defaults: LineDefaults, *, name: str = "<input>", parse: LineParser = parse_line
) -> Iterator[InputLine]:
    """Yield the non-blank lines of a JSONL stream, one at a time.

    A UTF-8 byte order mark at the start is skipped.

    Args:
        stream: The raw lines.
        defaults: What every line gets unless it says otherwise.
        name: The input's name, for messages.
        parse: The line format (``parse_line`` for prompt lines; ``openai_batch.parse_batch_line`` for batch files).

    Raises:
        BatchInputError: an id repeats an earlier line's id (the message names both line numbers), the file
            ends its lines with a carriage return alone (classic Mac line endings), which reads as one long line,
            or it is UTF-16 or UTF-32, not UTF-8.
    """
    first_line: Dict[str, int] = {}  # ids only, so memory stays small however long the input
    for number, raw in enumerate(stream, 1):
        if number == 1:
            _refuse_wide_encoding(raw, name)
            if raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM) :]
        line = parse(raw, number, defaults)
        if line is not None and line.error and b"\r" in raw.rstrip(b"\r\n"):
            raise BatchInputError(
                f"{name}: line {number} holds carriage returns (CR) without line feeds: the file uses CR-only line "
                "endings (classic Mac), so its lines run together. Convert them to LF, e.g. "
                "tr '\\r' '\\n' < in.jsonl > fixed.jsonl, then run again",
                path=name,
                line_number=number,
            )
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


def _refuse_wide_encoding(first: bytes, name: str) -> None:
    """Refuse a UTF-16 or UTF-32 input at its first line, before its NUL bytes make phantom lines."""
    if not first.startswith(_UTF16_BOMS) and b"\x00" not in first:
        return
    raise BatchInputError(
        f"{name} is not UTF-8: it is UTF-16 or UTF-32 (it starts with a UTF-16 byte order mark or holds NUL bytes), "
        "as PowerShell's > writes. Convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 in.jsonl > in-utf8.jsonl "
        "(or Out-File -Encoding utf8), then run again",
        path=name,
        line_number=1,
    )


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
        removed_temporaries: Leftover temporary files of earlier killed rewrites that were removed.
        memory: What the output remembers of its settings (``open_output`` with settings), else None.
    """

    done: Set[str] = field(default_factory=set)
    kept_errors: int = 0
    dropped_errors: int = 0
    dropped_torn: int = 0
    rewritten: bool = False
    removed_temporaries: List[str] = field(default_factory=list)
    memory: Optional[OutputMemory] = None


#: Reads an output record's resume key and whether it failed; None for a record that is not one of ours.
RecordKey = Callable[[Dict[str, Any]], Optional[Tuple[Optional[str], bool]]]


def record_key(record: Dict[str, Any]) -> Optional[Tuple[Optional[str], bool]]:
    """Return the resume key of a prompt-format output record and whether it failed (None: not a record)."""
    line_id = record.get("id")
    if line_id is None and "error" in record:
        return None, True  # the error record of a line whose id could not be read: it runs again
    if isinstance(line_id, bool) or not isinstance(line_id, (str, int)):
        return None
    return id_key(line_id), "error" in record


def _scan(
    lines: Iterable[bytes], retry_failed: bool, state: ResumeState, key_of: RecordKey = record_key
) -> Iterator[Tuple[bytes, bool]]:
    """Yield ``(line, keep)`` for each output line; fill ``state`` (the one decision both passes share)."""
    for raw in lines:
        record = json_object_line(raw)  # None: torn by a kill mid-write, or no record of ours
        read = None if record is None else key_of(record)
        if read is None:
            state.dropped_torn += 1
            yield raw, False
            continue
        key, failed = read
        if key is None:  # an error record of a line without an id (a bad line): it runs again
            state.dropped_errors += 1
            yield raw, False
            continue
        keep = key not in state.done and not (failed and retry_failed)
        if keep:
            state.done.add(key)
            state.kept_errors += failed
        elif failed and retry_failed:
            state.dropped_errors += 1
        yield raw, keep


def prepare_output(path: str, *, retry_failed: bool = True, key_of: RecordKey = record_key) -> ResumeState:
    """Read an existing output file into a resume set, dropping torn lines and (by default) error lines.

    The file is read twice, streaming (only ids are kept in memory). When lines must go, the kept ones are copied
    to a temporary file beside it (``.<name>.<8 random>.tmp``), fsynced, and moved over it with ``os.replace``, so a
    crash leaves the old file or the new one, never a mix. Duplicate ids keep their first line.

    All of this runs under the output's one-writer lock (``one_writer``: another run writing the same output is
    refused at once), so the temporaries of that pattern found meanwhile belong to earlier runs that were killed
    mid-rewrite: they are removed. Where nothing can be locked (Windows) no temporary is removed.

    Args:
        path: The output file; a missing file gives an empty state.
        retry_failed: Drop error lines, so their ids run again.
        key_of: The output format's resume key (``record_key``; ``openai_batch.batch_record_key`` keys by custom_id).

    Raises:
        LoraSamplerError: another run writes this output.
    """
    with one_writer(path) as held:
        return _prepare(path, retry_failed, key_of, held)


def _prepare(path: str, retry_failed: bool, key_of: RecordKey, held: bool) -> ResumeState:
    """``prepare_output`` with the one-writer lock taken (``held``: False where nothing could be locked)."""
    state = ResumeState()
    if not os.path.exists(path):
        return state
    if held:
        state.removed_temporaries = _remove_stale_temporaries(path)
    with open(path, "rb") as f:
        needs_rewrite = sum(not keep for _, keep in _scan(f, retry_failed, state, key_of)) > 0  # reads every line
    if not needs_rewrite:
        return state
    with replacing(path) as out, open(path, "rb") as f:
        for raw, keep in _scan(f, retry_failed, ResumeState(), key_of):
            if keep:
                out.write(raw)
    state.rewritten = True
    return state


@contextlib.contextmanager
def one_writer(path: str, *, refusal: str = "", unlocked: str = "") -> Iterator[bool]:
    """Hold the one-writer lock of the output at ``path`` for the block, or refuse at once; yield whether it is held.

    The lock is an exclusive ``flock`` on ``.<name>.lock`` beside the output, held for the whole run (the output
    itself is replaced by a resume's rewrite, so it cannot carry the lock). Every command that writes an output
    (``sample``, and the jobs built on ``open_output``) takes it, and so does a sweep's ledger, so two runs never
    duplicate or lose records. The lock file stays; the lock goes with the process, even on a kill. Without
    ``fcntl`` (Windows), or on a filesystem without locks, nothing is locked.

    Args:
        path: The output.
        refusal: The message when another run holds the lock ("": one naming the output and ``--output``).
        unlocked: What going on without a lock leaves to the user, for the warning ("": keeping other runs away).

    Raises:
        LoraSamplerError: another run holds the lock (the message names the output and the fix).
    """
    lock_path = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock")
    fd = _open_lock_file(lock_path)
    if fd is None:
        yield False
        return
    try:
        held = try_flock(fd, lock_path, unlocked=unlocked or f"make sure no other run writes {path} meanwhile")
        if held is False:
            raise LoraSamplerError(
                refusal
                or f"another run is writing {path} (it holds {lock_path}); two writers would duplicate or lose "
                "records. Wait for it to end, then run again with the same --output to resume, or pass another --output"
            )
        yield bool(held)
    finally:
        os.close(fd)


def _open_lock_file(lock_path: str) -> Optional[int]:
    if not HAS_FLOCK:  # pragma: no cover - Windows
        return None
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:  # a folder we cannot write: opening the output will say so
        logger.debug("cannot create %s (%s); the output is not locked", lock_path, error)
        return None


@contextlib.contextmanager
def open_output(
    path: str,
    *,
    retry_failed: bool = True,
    key_of: RecordKey = record_key,
    settings: Optional[Mapping[str, Any]] = None,
    restart: bool = False,
) -> Iterator[Tuple[ResumeState, IO[str]]]:
    """Take the output's one-writer lock, prepare it for resume and open it for appending, for the whole block.

    Args:
        path: The output file (created when missing).
        retry_failed: Drop error lines, so their ids run again (``prepare_output``).
        key_of: The output format's resume key.
        settings: The job's settings that change answers (``LineFormat.settings``): remembered beside the output, and
            compared with what it remembers (``ResumeState.memory``); None remembers nothing.
        restart: Empty the output (and forget its settings) first: every line runs again.

    Yields:
        ``(the resume state, the text stream to write records to)``.

    Raises:
        OutputSettingsError: the output holds answers made with other settings (nothing was changed).
        LoraSamplerError: another run writes this output, or it cannot be written (its message names the path).
    """
    with one_writer(path) as held:
        if restart and os.path.exists(path):
            with replacing(path):
                pass  # an empty file, whole or not at all
        state = _prepare(path, retry_failed, key_of, held)
        state.memory = None if settings is None else OutputMemory(path, settings, state.done, restart=restart)
        with state.memory or contextlib.nullcontext():
            try:
                stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed below, its error translated
            except OSError as exc:
                raise output_error(path, exc) from None
            try:
                yield state, stream
            finally:
                try:
                    stream.close()
                except OSError as exc:  # the last flush failed (a full disk): say it once, with the path
                    raise output_error(path, exc) from None


# tempfile.mkstemp's random part: 8 characters of this alphabet (stable since Python 3.0).
_TEMP_RANDOM = "[a-z0-9_]{8}"


def _remove_stale_temporaries(path: str) -> List[str]:
    """Remove the rewrite temporaries of ``path`` (own pattern, regular files only); the caller holds the lock."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(temp_prefix(path)) + _TEMP_RANDOM + re.escape(TEMP_SUFFIX))
    removed: List[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not pattern.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            logger.warning("removed %s, left by an earlier run of this output that was killed mid-rewrite", entry.path)
            removed.append(entry.path)
    return removed


# -- what the output remembers ------------------------------------------------------------------------------------
#
# In a file beside it (``<output>.settings``): the job's settings that change answers (the records' kind, the model
# or adapter, sampling and scoring settings, the extra body fields that carry chat and template settings) and one
# digest per answered id of its line's request (prompt, messages, completion and the line's own settings). A re-run
# that changes one is refused, naming it and the way out (a new output, or starting over); what does not change
# answers (concurrency, prompts per request, timeouts, retry-failed, the session id) is not remembered, so it
# changes freely.


#: The remembered settings' file: the output's path with this suffix (a name no ``*.jsonl`` glob matches).
SETTINGS_SUFFIX = ".settings"
#: The way out, in every refusal: Python spells the start-over flag ``restart=True``, the command line
#: ``--restart``.
WAY_OUT = "write to a new output, or pass --restart (Python: restart=True) to drop its answers and start over"


def settings_path(output: str) -> str:
    """Return the path of the file that remembers ``output``'s settings."""
    return output + SETTINGS_SUFFIX


def model_name(model: Union[AdapterSpec, None]) -> Optional[str]:
    """The name a model goes by in the settings: a published adapter's (content-derived) name, else as given."""
    if model is None:
        return None
    return model.name if isinstance(model, Adapter) else os.fspath(model)


def request_digest(request: Union[SampleRequest, ScoreRequest]) -> str:
    """Return a short digest of what in ``request`` changes its answer (its prompt, model and own settings)."""
    fields: Dict[str, Any] = {"prompt": request.prompt, "model": model_name(request.adapter) or request.base_model}
    if isinstance(request, ScoreRequest):
        fields["completion"] = request.completion
    else:
        fields.update(
            messages=request.messages,
            num_samples=request.num_samples,
            prompt_logprobs=request.prompt_logprobs,
            topk_prompt_logprobs=request.topk_prompt_logprobs,
            topk_sample_logprobs=request.topk_sample_logprobs,
            extra_body=request.extra_body,
            **dataclasses.asdict(request.sampling_params or SamplingParams()),
        )
    fields = {name: value for name, value in fields.items() if value not in (None, False)}  # unset: as if absent
    text = json.dumps(_plain(fields), sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("ascii", "backslashreplace"), digest_size=8).hexdigest()


def _plain(value: Any) -> Any:
    """Return ``value`` as plain JSON values (tuples as lists, mappings as dicts), for comparing and writing."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def settings_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """Say which remembered settings ``now`` changes (``temperature 0.7 -> 1.0``); "" when none.

    A setting remembered by an older version but not named now (or the other way round) is not compared.
    """
    changed = [
        f"{name} {before[name]!r} -> {now[name]!r}" for name in now if name in before and before[name] != now[name]
    ]
    return ", ".join(changed)


def check_remembered(
    output: str, settings: Mapping[str, Any], lines: Iterable[InputLine], key_of: RecordKey = record_key
) -> bool:
    """Refuse to take ``output`` as finished when it remembers other settings than ``settings``, or another request
    for an id it answered (a sweep's finished checkpoint is not opened again, so it is checked here); tell whether
    it answers every line of ``lines`` that has a request (False: lines were appended to the input since).

    Raises:
        OutputSettingsError: it does (the message names the setting or the line, and the way out).
    """
    remembered, digests = _read_file(settings_path(output))
    _refuse_changes(output, remembered, settings)
    answered = ResumeState()
    if os.path.exists(output):
        with open(output, "rb") as f:
            for _ in _scan(f, False, answered, key_of):  # read only: every record counts, failed ones too
                pass
    complete = True
    for line in lines:
        if line.key not in answered.done:
            complete = complete and line.request is None
            continue
        refusal = _changed_line(output, digests, line)
        if refusal is not None:
            raise refusal
    return complete


def _refuse_changes(output: str, remembered: Optional[Mapping[str, Any]], settings: Mapping[str, Any]) -> None:
    """Raise the refusal of an output remembering other settings than ``settings`` (nothing remembered: none)."""
    changes = "" if remembered is None else settings_changes(remembered, settings)
    if changes:
        raise OutputSettingsError(
            f"{output} holds answers made with other settings ({changes}); {WAY_OUT}",
            path=output,
            setting=changes.split(" ", 1)[0],
        )


def _changed_line(output: str, digests: Mapping[str, Optional[str]], line: InputLine) -> Optional[OutputSettingsError]:
    """The refusal of an answered line that now asks something else (its prompt or own settings changed); None when
    it asks the same, or when nothing is remembered of it."""
    remembered = digests.get(line.key)
    if remembered is None or line.request is None or remembered == request_digest(line.request):
        return None
    return OutputSettingsError(
        f"line {line.line_number} (id {line.id!r}) asks something else than the answer {output} holds for it (its "
        f"prompt, messages or own settings changed); {WAY_OUT}, or give the changed line a new id",
        path=output,
        setting=f"line {line.line_number}",
    )


class OutputMemory:
    """The remembered settings of one output, open for the run that writes it (the output's one-writer lock held);
    a context manager that closes its file.

    The file is appended to as the output is, never rewritten: each run adds the settings, then one digest per record
    before the record. Read back, the last settings and each id's last digest count; only the output's answered ids
    are ever asked about, so a digest of an id the output no longer holds (a failure run again) is never consulted
    (an id run again as a bad line, with no request, appends ``"line": null``: it forgets the earlier digest).

    Args:
        output: The output file.
        settings: The job's settings that change answers (``LineFormat.settings``).
        done: The resume set (the ids the output already holds): without any, nothing is compared.
        restart: Forget what the output remembers (the caller empties the output too).

    Raises:
        OutputSettingsError: the output was written with other settings (the message names them and the way out).
    """

    def __init__(self, output: str, settings: Mapping[str, Any], done: Set[str], *, restart: bool = False):
        self.output, self.path = output, settings_path(output)
        remembered, self._digests = (None, {}) if restart else _read_file(self.path)
        if done:
            _refuse_changes(output, remembered, settings)
        if remembered is None and done and not restart:
            logger.warning("%s remembers no settings (written by an older version); taking them as today's", output)
        try:  # __exit__ closes it
            self._stream = open(self.path, "w" if restart else "a", encoding="utf-8")  # noqa: SIM115
        except OSError as error:
            raise output_error(self.path, error, of=self.output) from None
        self._append("\n" + _line({"settings": dict(settings)}))  # the newline ends a line a kill tore: skipped

    def refusal(self, line: InputLine) -> Optional[OutputSettingsError]:
        """Return the refusal of an answered line that now asks something else (its prompt or own settings changed);
        None when it asks the same, or when nothing is remembered of it."""
        return _changed_line(self.output, self._digests, line)

    def remember(self, key: str, request: Union[SampleRequest, ScoreRequest, None]) -> None:
        """Remember the request of an id whose record is about to be written; a line without a request (a bad line)
        forgets what an earlier record of its id asked, as that record is no longer held (``"line": null``).

        Raises:
            OutputWriteError: the file cannot be written (a full disk).
        """
        digest = None if request is None else request_digest(request)
        if digest is None and self._digests.get(key) is None:
            return  # nothing remembered of it: nothing to forget
        self._digests[key] = digest
        self._append(_line({"id": key, "line": digest}))

    def _append(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError as error:
            raise output_error(self.path, error, of=self.output) from None

    def __enter__(self) -> OutputMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()


def _read_file(path: str) -> Tuple[Optional[Dict[str, Any]], Dict[str, Optional[str]]]:
    """Read remembered settings and digests (the last of each; a line torn by a kill is skipped); ``(None, {})``: no
    file."""
    settings: Optional[Dict[str, Any]] = None
    digests: Dict[str, Optional[str]] = {}
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return settings, digests
    with handle:
        for raw in handle:
            entry = json_object_line(raw)
            if entry is None:
                continue
            if isinstance(entry.get("settings"), dict):
                settings = entry["settings"]
            elif isinstance(entry.get("id"), str) and isinstance(entry.get("line"), (str, type(None))):
                digests[entry["id"]] = entry["line"]  # None: forgotten (a bad line's record replaced its id's)
    return settings, digests


def _line(entry: Dict[str, Any]) -> str:
    return json.dumps(entry, ensure_ascii=True, sort_keys=True, separators=(",", ":")) + "\n"


def output_error(path: Any, error: OSError, *, of: str = "") -> OutputWriteError:
    """Return the error of an output that cannot be written, naming it and saying that it resumes.

    Args:
        path: The file that cannot be written.
        error: Why.
        of: The output whose settings ``path`` remembers, when it is that file ("": ``path`` is the output).
    """
    reason = error.strerror or str(error)
    fix = "free some space" if error.errno in _FULL else "fix the cause"
    what = f"{path} (what {of} remembers of its settings)" if of else f"the output {path}"
    return OutputWriteError(
        f"cannot write {what}: {reason}. Every record written before is kept and the output is resumable: "
        f"{fix} and run again with the same --output {of or path}",
        path=str(path),
        reason=reason,
    )


#: The errors of a full disk or quota: the fix is to free some space.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# -- records -----------------------------------------------------------------------------------------------------


def result_record(line: InputLine, output: SampleOutput) -> Dict[str, Any]:
    """Return the output record of an answered line."""
    record: Dict[str, Any] = {
        "id": line.id,
        "model": output.model,
        "sequences": [
            {
                "tokens": list(s.tokens),
                "logprobs": [json_number(lp) for lp in s.logprobs],
                "text": s.text,
                "stop_reason": s.stop_reason,
            }
            for s in output.sequences
        ],
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [json_number(lp) for lp in output.prompt_logprobs]
    return add_metadata(record, line)


def add_metadata(record: Dict[str, Any], line: InputLine) -> Dict[str, Any]:
    """Return ``record`` with the line's ``metadata``, when it has some."""
    if line.metadata is not None:
        record[METADATA_KEY] = line.metadata
    return record


def error_text(line: InputLine, error: Union[BaseException, str]) -> Tuple[str, str]:
    """Return the type and the message of a failed line's error (a bad line's reason, or an exception)."""
    if isinstance(error, str):
        return "BatchInputError", f"line {line.line_number}: {error}"
    return type(error).__name__, str(error) or repr(error)


def error_record(line: InputLine, error: Union[BaseException, str], model: Optional[str] = None) -> Dict[str, Any]:
    """Return the output record of a failed line: the status (None without one), the error type and its message."""
    status = error.status if isinstance(error, EngineStatusError) else None
    kind, message = error_text(line, error)
    body: Dict[str, Any] = {"status": status, "type": kind, "message": message, "line": line.line_number}
    record: Dict[str, Any] = {"id": line.id}
    if model:
        record["model"] = model
    record["error"] = body
    return add_metadata(record, line)


@dataclass(frozen=True)
class LineFormat:
    """One kind of input line and its output records: how a raw line becomes a request, how its outcome becomes a
    record, and how a record is read back on resume.

    Attributes:
        parse: Parses one raw input line (``parse_line``'s signature; ``None`` for a blank line).
        result: Builds the record of an answered line (from its ``SampleOutput``, or its ``ScoreOutput``).
        error: Builds the record of a failed line (the error, or a bad line's reason; the model name when known).
        key_of: Reads a record's resume key (see ``prepare_output``).
        message_of: Reads a failed record's message, for the terminal.
        kind: What the records hold (``sample``, ``score``, ``openai-batch``): an output remembers it.
    """

    parse: LineParser
    result: Callable[[InputLine, Any], Dict[str, Any]]
    error: Callable[[InputLine, Union[BaseException, str], Optional[str]], Dict[str, Any]]
    key_of: RecordKey
    message_of: Callable[[Dict[str, Any]], str]
    kind: str

    def settings(self, defaults: LineDefaults, model: Union[AdapterSpec, None]) -> Dict[str, Any]:
        """Return the named settings of a job of these records that change its answers (remembered beside its
        output): the records' kind, the model every line asks (None: each line names its own), and what every line
        gets unless it says otherwise (``defaults``: completions per line, the sampling defaults, prompt logprobs,
        the extra body fields that carry chat and template settings)."""
        return {
            "kind": self.kind,
            "model": model_name(model),
            "num_samples": defaults.num_samples,
            **_plain(dataclasses.asdict(defaults.sampling_params)),
            "prompt_logprobs": defaults.prompt_logprobs,
            "extra_body": _plain(defaults.extra_body),
        }


def _error_message(record: Dict[str, Any]) -> str:
    error = record["error"]
    return (
        str(error["message"])
        if error["type"] == "BatchInputError"
        else f"line {error['line']} (id {record['id']!r}): {error['message']}"
    )


#: Prompt or messages lines (``parse_line``), and their records: ``{"id", "model", "sequences"}`` or
#: ``{"id", "error"}``.
PROMPT_LINES = LineFormat(parse_line, result_record, error_record, record_key, _error_message, kind="sample")


def to_json_line(record: Dict[str, Any], default: Optional[Callable[[Any], Any]] = None) -> str:
    """Return one record as one line of strict JSON: no NaN or Infinity (written as null), text that is UTF-8.

    Every writer of an output file goes through here. Lone surrogates (``\\ud800`` in an engine's text) are kept as
    JSON escapes, so the line still encodes as UTF-8.

    Args:
        record: The record.
        default: As ``json.dumps``'s: turns a value JSON has no type for into one it has.
    """
    try:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=default)
    except ValueError:  # a NaN or an Infinity somewhere: strict readers refuse them
        return to_json_line(_finite(record), default)
    if not line.isascii():
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            line = json.dumps(record, separators=(",", ":"), allow_nan=False, default=default)
    return line


def _finite(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_record(stream: IO[str], record: Dict[str, Any]) -> None:
    """Write one record as one complete line of strict JSON, and flush it.

    Raises:
        LoraSamplerError: the output cannot be written (a full disk): the message names it and says it resumes.
        RecursionError: the record is nested too deep to encode (an engine's answer echoed in it).
    """
    try:
        stream.write(to_json_line(record) + "\n")
        stream.flush()
    except BrokenPipeError:
        raise OutputClosedError(f"the reader of {getattr(stream, 'name', 'the output')} closed it") from None
    except OSError as exc:
        raise output_error(getattr(stream, "name", "the output"), exc) from None
