"""What an output remembers of how its answers were made, in a file beside it (``<output>.settings``).

The job's settings that change answers (the records' kind, the model or adapter, sampling and scoring settings, the
extra body fields that carry chat and template settings) and one digest per answered id of its line's request
(prompt, messages, completion and the line's own settings). A re-run that changes one is refused, naming it and the
way out (a new output, or starting over); what does not change answers (concurrency, prompts per request,
timeouts, retry-failed, the session id) is not remembered, so it changes freely. No HTTP, no threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
from typing import IO, Any, Dict, Iterable, Mapping, Optional, Protocol, Set, Tuple, Union

from lora_sampler._files import json_object_line, replacing
from lora_sampler.errors import OutputSettingsError, OutputWriteError
from lora_sampler.types import Adapter, AdapterSpec, SampleRequest, SamplingParams, ScoreRequest

logger = logging.getLogger(__name__)

#: The remembered settings' file: the output's path with this suffix (a name no ``*.jsonl`` glob matches).
SETTINGS_SUFFIX = ".settings"
#: The way out, in every refusal: Python spells the start-over flag ``restart=True``, the command line
#: ``--restart``.
WAY_OUT = "write to a new output, or pass --restart (Python: restart=True) to drop its answers and start over"


class AnsweredLine(Protocol):
    """What the memory reads of one input line (``_lines.InputLine``, whose module reads this one)."""

    @property
    def line_number(self) -> int: ...
    @property
    def id(self) -> object: ...
    @property
    def key(self) -> str: ...
    @property
    def request(self) -> Union[SampleRequest, ScoreRequest, None]: ...


def settings_path(output: str) -> str:
    """Return the path of the file that remembers ``output``'s settings."""
    return output + SETTINGS_SUFFIX


def model_name(model: Union[AdapterSpec, None]) -> Optional[str]:
    """The name a model goes by in the settings: a published adapter's (content-derived) name, else as given."""
    if model is None:
        return None
    return model.name if isinstance(model, Adapter) else os.fspath(model)


def job_settings(
    kind: str,
    model: Union[AdapterSpec, None],
    *,
    num_samples: int = 1,
    sampling_params: Optional[SamplingParams] = None,
    prompt_logprobs: bool = False,
    extra_body: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Return the named settings of a job that change its answers (what every line gets unless it says otherwise).

    Args:
        kind: The records' kind (``sample``, ``score``, ``openai-batch``).
        model: The adapter or base model every line asks (None: each line names its own).
        num_samples: Completions per line.
        sampling_params: The sampling defaults.
        prompt_logprobs: Whether prompt lines also return the prompt's logprobs.
        extra_body: Further body fields of every request (chat and template settings among them).
    """
    params = sampling_params or SamplingParams()
    return {
        "kind": kind,
        "model": model_name(model),
        "num_samples": num_samples,
        **_plain(dataclasses.asdict(params)),
        "prompt_logprobs": prompt_logprobs,
        "extra_body": _plain(extra_body),
    }


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


def check_remembered(output: str, settings: Mapping[str, Any], lines: Iterable[AnsweredLine] = ()) -> None:
    """Refuse to take ``output`` as finished when it remembers other settings than ``settings``, or another request
    for the id of one of ``lines`` (a sweep's finished checkpoint is not opened again, so it is checked here).

    Raises:
        OutputSettingsError: it does (the message names the setting or the line, and the way out).
    """
    remembered, digests = _read_file(settings_path(output))
    _refuse_changes(output, remembered, settings)
    for line in lines if digests else ():
        refusal = _changed_line(output, digests, line)
        if refusal is not None:
            raise refusal


def _refuse_changes(output: str, remembered: Optional[Mapping[str, Any]], settings: Mapping[str, Any]) -> None:
    """Raise the refusal of an output remembering other settings than ``settings`` (nothing remembered: none)."""
    changes = "" if remembered is None else settings_changes(remembered, settings)
    if changes:
        raise OutputSettingsError(
            f"{output} holds answers made with other settings ({changes}); {WAY_OUT}",
            path=output,
            setting=changes.split(" ", 1)[0],
        )


def _changed_line(output: str, digests: Mapping[str, str], line: AnsweredLine) -> Optional[OutputSettingsError]:
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

    Args:
        output: The output file.
        settings: The job's settings that change answers (``job_settings``).
        done: The resume set (the ids the output already holds); the others' digests are dropped.
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
        self._digests = {key: digest for key, digest in self._digests.items() if key in done}
        self._stream = self._rewrite(settings)

    def _rewrite(self, settings: Mapping[str, Any]) -> IO[str]:
        """Write the file afresh (the settings, then the digests of the ids still answered); open it to append."""
        try:
            with replacing(self.path) as out:
                out.write(_line({"settings": dict(settings)}).encode("ascii"))
                for key, digest in self._digests.items():
                    out.write(_line({"id": key, "line": digest}).encode("ascii"))
            return open(self.path, "a", encoding="utf-8")
        except OSError as error:
            raise output_error(self.path, error, of=self.output) from None

    def refusal(self, line: AnsweredLine) -> Optional[OutputSettingsError]:
        """Return the refusal of an answered line that now asks something else (its prompt or own settings changed);
        None when it asks the same, or when nothing is remembered of it."""
        return _changed_line(self.output, self._digests, line)

    def remember(self, key: str, request: Union[SampleRequest, ScoreRequest, None]) -> None:
        """Remember the request of an id whose record is about to be written (a line without a request: nothing).

        Raises:
            OutputWriteError: the file cannot be written (a full disk).
        """
        if request is None:
            return
        digest = request_digest(request)
        self._digests[key] = digest
        try:
            self._stream.write(_line({"id": key, "line": digest}))
            self._stream.flush()
        except OSError as error:
            raise output_error(self.path, error, of=self.output) from None

    def __enter__(self) -> OutputMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()


def _read_file(path: str) -> Tuple[Optional[Dict[str, Any]], Dict[str, str]]:
    """Read remembered settings and digests (a torn last line from a kill is skipped); ``(None, {})``: no file."""
    settings: Optional[Dict[str, Any]] = None
    digests: Dict[str, str] = {}
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
            elif isinstance(entry.get("id"), str) and isinstance(entry.get("line"), str):
                digests[entry["id"]] = entry["line"]
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
