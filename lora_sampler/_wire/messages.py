"""The body fields of a completion request: the sampling field names, and the checks of texts, chat messages and extras.

The checks run before any request is sent. No I/O here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

#: ``SamplingParams`` fields vLLM reads under the same names (``stop`` is split into ``stop``/``stop_token_ids``).
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
#: The body field asking for the prompt tokens' logprobs (a scoring request: the client keeps it apart, see isolation).
PROMPT_LOGPROBS_FIELD = "prompt_logprobs"
#: Chat roles ``messages`` may use (the OpenAI chat roles vLLM's chat templates take).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: Body fields a ``SampleRequest`` sets itself: ``extra_body`` may not hold them (use the named argument instead).
OWN_FIELDS = {
    "model": "adapter= or base_model=",
    "prompt": "prompt=",
    "messages": "messages=",
    "n": "num_samples=",
    "max_tokens": "sampling_params=SamplingParams(max_tokens=...)",
    "max_completion_tokens": "sampling_params=SamplingParams(max_tokens=...)",
    "temperature": "sampling_params=SamplingParams(temperature=...)",
    "top_p": "sampling_params=SamplingParams(top_p=...)",
    "top_k": "sampling_params=SamplingParams(top_k=...)",
    "seed": "sampling_params=SamplingParams(seed=...)",
    "stop": "sampling_params=SamplingParams(stop=...)",
    "stop_token_ids": "sampling_params=SamplingParams(stop=[token ids])",
    "logprobs": "nothing: the sampled tokens' logprobs are always asked for",
    "return_token_ids": "nothing: token ids are always asked for",
    "prompt_logprobs": "prompt_logprobs= or topk_prompt_logprobs=",
    "stream": "nothing: answers are never streamed",
}


def text_problem(value: str) -> str:
    """Return what makes ``value`` no text to send or write as UTF-8 (a lone surrogate such as ``\\ud800``), or ""."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate (\\u{ord(value[exc.start]):04x}) at character {exc.start}, which is not text"
    return ""


def check_text(value: str, what: str) -> None:
    """Refuse a text to send that is no text (``text_problem``), naming it (``what``) and the fix."""
    problem = text_problem(value)
    if problem:
        raise ValueError(f"{what} {problem}; decode its source with errors='replace', or fix it")


def validated_messages(messages: object) -> Tuple[Dict[str, Any], ...]:
    """Check chat messages before any request: a non-empty list of ``{"role", "content"}`` with known roles.

    ``content`` is a string or a list of text parts (``{"type": "text", "text": ...}``); other keys are kept.

    Raises:
        TypeError, ValueError: naming the message (by position) and what is wrong with it.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    checked = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where} has role {role!r}; a role is one of {', '.join(CHAT_ROLES)}")
        if "content" not in message:
            raise ValueError(f"{where} has no 'content' (a string, or a list of text parts)")
        for text in _texts_of(message["content"], where):
            check_text(text, f"{where} content")
        checked.append(dict(message))
    return tuple(checked)


def _texts_of(content: object, where: str) -> List[str]:
    """Return the texts of a message's content: a string, or a list of ``{"type": "text", "text": str}`` parts."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return [part["text"] for part in content]
    raise TypeError(
        f"{where} content must be a string or a list of {{'type': 'text', 'text': str}} parts, got {content!r}"
    )


def validated_extra_body(extra_body: object) -> Dict[str, Any]:
    """Check extra body fields: string keys, none of ``OWN_FIELDS``.

    Raises:
        TypeError, ValueError: naming the field and the argument to use instead.
    """
    if not isinstance(extra_body, Mapping):
        raise TypeError(f"extra_body must be a dict of body fields, got {type(extra_body).__name__}")
    for key in extra_body:
        if not isinstance(key, str):
            raise TypeError(f"extra_body keys must be strings, got {key!r}")
        if key in OWN_FIELDS:
            raise ValueError(f"extra_body may not set {key!r}: the request sets it; use {OWN_FIELDS[key]}")
    return dict(extra_body)


def load_adapter_body(name: str, path: str) -> Dict[str, str]:
    """Return the body of ``POST /v1/load_lora_adapter``: the adapter's name and its folder as the engine sees it."""
    return {"lora_name": name, "lora_path": path}


def unload_adapter_body(name: str) -> Dict[str, str]:
    """Return the body of ``POST /v1/unload_lora_adapter``."""
    return {"lora_name": name}
