"""The OpenAI batch file format: the input lines ``vllm run-batch`` and the OpenAI Batch API read, and their output.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"}``;
an output line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the shape
``vllm run-batch`` writes (vLLM 0.32, ``entrypoints/launchers/run_batch.py``):

* answered: ``response.status_code`` 200, ``response.body`` the engine's answer as it came, ``error`` null;
* the engine refused it: ``response.status_code`` its status, ``response.body`` null, ``error`` the engine's error
  body (``{"error": {"message", "type", "param", "code"}}``);
* no HTTP answer (transport failure after the retries, a bad line, a checkpoint that cannot be published):
  ``response`` null and ``error`` ``{"message", "type", "line"}``.

``body.model`` names the adapter, or the base model when the engine serves a base model of that name; an explicit
adapter or base model (``--adapter``/``--base-model``) overrides it on every line. Every other field of ``body``
reaches the engine: the sampling fields through ``SamplingParams``, the rest as they are (``extra_body``); the few
that cannot (a streamed answer, fewer logprobs or no token ids) are refused with the field and the line. Fields
the body leaves out take the defaults (the CLI's flags, e.g. ``--max-tokens``), where vLLM would take its own.
Parsing and records only: no HTTP and no threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from lora_sampler._wire.messages import SAMPLING_FIELDS, text_problem
from lora_sampler._wire.routes import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH
from lora_sampler.batch._lines import (
    UTF8_BOM,
    InputLine,
    LineDefaults,
    LineFormat,
    LineId,
    check_keys,
    error_text,
    id_key,
    is_blank,
    loads_line,
    parse_object_line,
)
from lora_sampler.errors import EngineStatusError, status_class
from lora_sampler.types import AdapterSpec, SampleOutput, SampleRequest, SamplingParams, is_checkpoint_path

__all__ = [
    "BATCH_LINES",
    "BATCH_URLS",
    "CHAT_URL",
    "COMPLETIONS_URL",
    "LINE_KEYS",
    "OPENAI_BATCH_FORMAT",
    "PROMPT_FORMAT",
    "batch_error_record",
    "batch_record_key",
    "batch_result_record",
    "detect_format",
    "file_format",
    "is_batch_line",
    "parse_batch_line",
]

#: The endpoint of a chat line (its ``url``).
CHAT_URL = CHAT_COMPLETIONS_PATH
#: The endpoint of a completions line.
COMPLETIONS_URL = COMPLETIONS_PATH
#: The endpoints a batch line may name.
BATCH_URLS = (CHAT_URL, COMPLETIONS_URL)
#: The keys of an input line.
LINE_KEYS = ("custom_id", "method", "url", "body")
#: Format names of ``lora-sampler sample --format``.
PROMPT_FORMAT, OPENAI_BATCH_FORMAT = "jsonl", "openai-batch"


def is_batch_line(raw: bytes) -> bool:
    """Tell whether a raw line is an OpenAI batch line (a JSON object with ``custom_id`` and ``body``)."""
    try:
        obj = loads_line(raw[len(UTF8_BOM) :] if raw.startswith(UTF8_BOM) else raw)
    except ValueError:
        return False
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


def detect_format(lines: Iterable[bytes]) -> Tuple[str, Iterator[bytes]]:
    """Pick the input format from the first non-blank line; return it and the lines, none consumed.

    Returns:
        ``(OPENAI_BATCH_FORMAT or PROMPT_FORMAT, an iterator over every line from the first)``.
    """
    first, replay = first_line(lines)
    found = OPENAI_BATCH_FORMAT if first is not None and is_batch_line(first) else PROMPT_FORMAT
    return found, replay


def first_line(lines: Iterable[bytes]) -> Tuple[Optional[bytes], Iterator[bytes]]:
    """Return the first non-blank line (None when all are blank) and an iterator over every line, none consumed."""
    source = iter(lines)
    head: List[bytes] = []
    for raw in source:
        head.append(raw)
        if not is_blank(raw):
            break
    return (head[-1] if head and not is_blank(head[-1]) else None), itertools.chain(head, source)


def file_format(path: str) -> str:
    """Return the format of the input file at ``path``, from its first non-blank line (``detect_format``)."""
    with open(path, "rb") as f:
        return detect_format(f)[0]


def parse_batch_line(raw: bytes, line_number: int, defaults: LineDefaults) -> Optional[InputLine]:
    """Parse one batch input line; None for a blank line. Never raises for bad content: see ``InputLine.error``.

    Args:
        raw: The line.
        line_number: Its 1-based number (named in every refusal).
        defaults: The sampling defaults; its adapter or base model, when set, overrides ``body.model``, else a
            ``body.model`` among its ``base_models`` samples that base model.

    Returns:
        The line; its id is the ``custom_id`` (None when it has none that can be one: the line is bad).
    """
    return parse_object_line(raw, line_number, defaults, _request, _custom_id)


def _custom_id(obj: Dict[str, Any], line_number: int) -> LineId:
    """A line's ``custom_id``: a non-empty text (a ``ValueError`` naming what it is instead)."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        problem = "has no custom_id" if custom_id is None else f"has custom_id {custom_id!r}"
        raise ValueError(f"the line {problem}; give every line a unique string id")
    if text_problem(custom_id):
        raise ValueError(f"the custom_id {text_problem(custom_id)}; give the line a text custom_id")
    return custom_id


def _request(obj: Dict[str, Any], defaults: LineDefaults) -> SampleRequest:
    url, rest = _envelope(obj)
    adapter, base_model = _target(rest.pop("model", None), defaults)
    chat = url == CHAT_URL
    text_field, text = _text(rest, url, chat)
    num_samples = _num_samples(rest.pop("n", None), defaults.num_samples)
    params = _sampling_params(rest, defaults.sampling_params, chat)
    prompt_logprobs = _refuse_unsendable(rest, chat)
    try:
        return SampleRequest(
            None if chat else text,
            messages=text if chat else None,
            adapter=adapter,
            base_model=base_model,
            num_samples=num_samples,
            sampling_params=params,
            prompt_logprobs=prompt_logprobs == 0,
            topk_prompt_logprobs=prompt_logprobs or 0,
            extra_body={**(defaults.extra_body or {}), **rest} or None,  # the line's body over --extra-body
        )
    except (TypeError, ValueError) as exc:  # the prompt or the messages: SampleRequest names them
        raise ValueError(f"body.{exc}" if str(exc).startswith(text_field) else str(exc)) from None


def _text(rest: Dict[str, Any], url: str, chat: bool) -> Tuple[str, Any]:
    """Pop the line's text (body.messages in a chat line, body.prompt in a completions line): its field and it."""
    text_field, other_field = ("messages", "prompt") if chat else ("prompt", "messages")
    if other_field in rest:
        raise ValueError(f"body.{other_field} does not belong in a {url} line; use body.{text_field}")
    if text_field not in rest:
        raise ValueError(f"body.{text_field} is missing")
    return text_field, rest.pop(text_field)


def _envelope(obj: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """Check a line's keys, method and url; return the url and a copy of its body."""
    check_keys(obj, LINE_KEYS, {})
    if obj.get("method") != "POST":
        raise ValueError(f"method must be \"POST\", got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in BATCH_URLS:
        raise ValueError(f"url {url!r} is not supported; use {' or '.join(BATCH_URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    return str(url), dict(body)


def _target(model: Any, defaults: LineDefaults) -> Tuple[Optional[AdapterSpec], Optional[str]]:
    """Return ``(adapter, base_model)``: the command's, else body.model (a base model when the engine serves it)."""
    adapter, base_model = defaults.adapter, defaults.base_model
    if adapter is not None or base_model is not None:
        return adapter, base_model
    if not isinstance(model, str) or not model:
        raise ValueError("body.model must name the adapter (or the base model); or pass --adapter")
    if model in defaults.base_models:  # the engine's served name, which vLLM often spells as its model folder's path
        return None, model
    if is_checkpoint_path(model) and not defaults.allow_model_paths:
        raise ValueError(
            f"body.model {model!r} is a local path: a batch file names adapters and models by name, so it cannot "
            "copy folders into the shared adapter folder. Publish it first (lora-sampler publish), or pass "
            "--allow-model-paths if this file may name checkpoints"
        )
    return model, None


def _num_samples(value: Any, default: int) -> int:
    """Return body.n, checked, or the default when it is absent or null."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"body.n must be an integer >= 1, got {value!r}")
    return value


def _sampling_params(rest: Dict[str, Any], defaults: SamplingParams, chat: bool) -> SamplingParams:
    """Pop the sampling fields off ``rest`` into ``SamplingParams`` (a null field keeps the default)."""
    given = {name: rest.pop(name, None) for name in (*SAMPLING_FIELDS, "max_completion_tokens")}
    limit = given.pop("max_completion_tokens")
    if limit is not None and not chat:
        raise ValueError("body.max_completion_tokens belongs to chat lines; use body.max_tokens in a completions line")
    if limit is not None:  # vLLM's chat takes max_completion_tokens over max_tokens
        given["max_tokens"] = limit
    values = {**dataclasses.asdict(defaults), **{name: value for name, value in given.items() if value is not None}}
    stop, stop_ids = rest.pop("stop", None), rest.pop("stop_token_ids", None)
    if stop is not None or stop_ids is not None:
        values["stop"] = _stop(stop, stop_ids)
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"body: {exc}") from None


def _stop(stop: Any, stop_ids: Any) -> Optional[List[Union[str, int]]]:
    """Return body.stop (a string or strings) and body.stop_token_ids as one ``stop`` list (None when empty)."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"body.stop must be a string or a list of strings, got {stop!r}")
    if not isinstance(stop_ids or [], list):
        raise ValueError(f"body.stop_token_ids must be a list of token ids, got {stop_ids!r}")
    return [*strings, *(stop_ids or [])] or None


def _refuse_unsendable(rest: Dict[str, Any], chat: bool) -> Optional[int]:
    """Pop the fields lora_sampler sets itself, refusing values it would change; return prompt_logprobs."""
    if rest.pop("stream", None):
        raise ValueError("body.stream=true is not supported: batch answers are read whole; remove it")
    if rest.pop("return_token_ids", True) is False:
        raise ValueError("body.return_token_ids=false is not supported: token ids are always returned; remove it")
    _check_logprobs(rest.pop("logprobs", None), chat)
    prompt_logprobs = rest.pop("prompt_logprobs", None)
    if prompt_logprobs is not None and (
        chat or isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int)
    ):
        where = "a chat line" if chat else "a completions line (an integer >= 0 is)"
        raise ValueError(f"body.prompt_logprobs={prompt_logprobs!r} is not supported in {where}")
    return prompt_logprobs


def _check_logprobs(logprobs: Any, chat: bool) -> None:
    """Refuse a body.logprobs that asks for other logprobs than the sampled token's (always returned)."""
    if chat and logprobs not in (None, True, False):
        raise ValueError(f"body.logprobs must be true or false in a chat line, got {logprobs!r}")
    if not chat and logprobs not in (None, 0, 1):
        raise ValueError(
            f"body.logprobs={logprobs!r} is not supported in a completions line: the sampled token's logprob "
            "(logprobs=1) is always returned; remove it or set it to 1"
        )


# -- output --------------------------------------------------------------------------------------------------------


def _output_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _output_line(custom_id: Optional[LineId], response: Optional[Dict[str, Any]], error: Any) -> Dict[str, Any]:
    """One output line in ``vllm run-batch``'s shape, with an ``id`` of its own."""
    return {"id": _output_id(), "custom_id": custom_id, "response": response, "error": error}


def batch_result_record(line: InputLine, output: SampleOutput) -> Dict[str, Any]:
    """Return the output line of an answered request: the engine's body as it came."""
    body = output.body or {}
    request_id = body.get("id") if isinstance(body.get("id"), str) else _output_id()
    return _output_line(line.id, {"status_code": 200, "request_id": request_id, "body": output.body}, None)


def batch_error_record(
    line: InputLine, error: Union[BaseException, str], model: Optional[str] = None
) -> Dict[str, Any]:
    """Return the output line of a failed request (the status and the engine's error body, or the reason)."""
    if isinstance(error, EngineStatusError):
        request_id = error.request_id or _output_id()
        response = {"status_code": error.status, "request_id": request_id, "body": None}
        return _output_line(line.id, response, _engine_error_body(error))
    kind, message = error_text(line, error)
    return _output_line(line.id, None, {"message": message, "type": kind, "line": line.line_number})


def _engine_error_body(error: EngineStatusError) -> Dict[str, Any]:
    """The engine's error body as vLLM's run-batch writes it: ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        body = error.response.json() if error.response is not None else None
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    return {
        "error": {
            "message": error.engine_message or error.message,
            "type": status_class(error.status).__name__,  # vLLM's body names the status as the OpenAI SDK does
            "param": None,
            "code": error.status,
        }
    }


def batch_record_key(record: Dict[str, Any]) -> Optional[Tuple[Optional[str], bool]]:
    """Return a batch output line's resume key (its custom_id) and whether it failed; None: not a batch line."""
    if "custom_id" not in record or "response" not in record or "error" not in record:
        return None
    custom_id = record["custom_id"]
    response = record["response"]
    failed = record["error"] is not None or not isinstance(response, dict) or response.get("status_code") != 200
    return (id_key(custom_id) if isinstance(custom_id, str) else None), failed


def _batch_error_message(record: Dict[str, Any]) -> str:
    error: Dict[str, Any] = record["error"] or {}
    inner = error["error"] if isinstance(error.get("error"), dict) else error
    message = str(inner.get("message", error))
    if record.get("custom_id") is None:
        return message
    status = (record.get("response") or {}).get("status_code")
    return f"custom_id {record['custom_id']!r}: {f'HTTP {status}: ' if status else ''}{message}"


#: OpenAI batch lines (``parse_batch_line``) and their output lines, resumed by custom_id.
BATCH_LINES = LineFormat(
    parse_batch_line, batch_result_record, batch_error_record, batch_record_key, _batch_error_message, "openai-batch"
)
