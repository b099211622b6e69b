"""FakeEngine's ``/v1/chat/completions``: the fixed chat template, and chat requests and answers in vLLM's shape.

The fake renders messages with one fixed template, the same one ``tests/real_engine/build_tiny_model.py`` gives the
tiny model the real-engine tests serve (``CHAT_TEMPLATE``, Jinja)::

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

Each message is ``<|ROLE|>``, a newline, its content and a newline; the generation prompt ``<|assistant|>`` and a
newline end it. Content given as text parts is joined with newlines (vLLM's "string" content format). A
``developer`` message is rendered as ``system``, as vLLM does for a template that does not name that role. The fake
tokenizes the rendered text with its byte tokenizer (no BOS) and generates exactly as ``/v1/completions`` does
for that prompt, so a chat request and the completion of its rendered prompt give the same token ids.

No HTTP and no engine state here: the engine routes the request and checks the model, this module translates the
request into a completion and the answer back. Stdlib only.
"""

from __future__ import annotations

import uuid
from typing import Any

from lora_sampler._wire.messages import SAMPLING_FIELDS

#: The chat template as Jinja, for a tokenizer's ``chat_template`` (the fake renders it with ``render_chat``).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
#: The roles a message may have (the OpenAI chat roles vLLM's templates take): the fake's own list, not the client's,
#: so a client that sends another role is caught here.
ROLES = ("system", "developer", "user", "assistant", "tool")
#: What the template appends for the reply (the generation prompt).
GENERATION_PROMPT = "<|assistant|>\n"
#: Completion fields a chat request carries over unchanged (``max_tokens`` is set from either limit below).
_SHARED_FIELDS = ("model", "n", *SAMPLING_FIELDS, "stop", "stop_token_ids", "return_token_ids")


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "\n".join(part["text"] for part in content)
    return None


def render_chat(
    messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """Render ``messages`` with the fixed template (messages already checked).

    ``add_generation_prompt`` (default true) ends it with the reply's header; ``continue_final_message`` ends it
    inside the final message (without the newline that closes it).
    """
    rendered = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append(f"<|{role}|>\n{_content_text(message['content'])}\n")
    text = "".join(rendered) + (GENERATION_PROMPT if add_generation_prompt else "")
    return text[:-1] if continue_final_message else text


def _messages(payload: dict[str, Any]) -> list[dict[str, Any]] | str:
    """A chat request's messages, checked, or the 400 message for messages that are not a non-empty list of
    ``{role, content}``."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} objects"
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"messages[{position}] needs a role, one of {', '.join(ROLES)}"
        if _content_text(message.get("content")) is None:
            return f"messages[{position}].content must be a string or a list of text parts"
    return messages


def rendered_prompt(payload: dict[str, Any]) -> str | tuple[str]:
    """The text vLLM's chat ``/tokenize`` tokenizes for ``payload``, or ``(message,)`` for its 400 (vLLM refuses
    ``add_generation_prompt`` and ``continue_final_message`` both true)."""
    messages = _messages(payload)
    if isinstance(messages, str):
        return (messages,)
    generation, continuation = payload.get("add_generation_prompt", True), payload.get("continue_final_message", False)
    if generation and continuation:
        return ("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",)
    return render_chat(messages, add_generation_prompt=generation, continue_final_message=continuation)


def completion_payload(payload: dict[str, Any]) -> dict[str, Any] | str:
    """Translate a chat request into the ``/v1/completions`` request of its rendered prompt (``rendered_prompt``: as
    ``/tokenize`` renders it), or a 400 message."""
    rendered = rendered_prompt(payload)
    if isinstance(rendered, tuple):
        return rendered[0]
    logprobs, top = payload.get("logprobs"), payload.get("top_logprobs")
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and top >= 0):
        return "top_logprobs must be a non-negative integer"
    if top and not logprobs:
        return "when using `top_logprobs`, `logprobs` must be set to true."
    translated = {key: payload[key] for key in _SHARED_FIELDS if key in payload}
    translated["prompt"] = rendered
    limit = payload.get("max_completion_tokens")
    translated["max_tokens"] = limit if limit is not None else payload.get("max_tokens")
    # The completion sampler always returns the sampled token; top_logprobs alternatives are trimmed in chat_body.
    translated["logprobs"] = (top or 0) if logprobs else None
    return translated


def chat_body(completion: dict[str, Any], request: dict[str, Any], prompt: str) -> dict[str, Any]:
    """Turn the fake's completion body into vLLM 0.32's ``ChatCompletionResponse`` (every field it sends).

    Args:
        completion: The completion body of the rendered prompt.
        request: The chat request (``top_logprobs``, ``return_token_ids`` and ``return_prompt_text`` shape it).
        prompt: The rendered prompt (``prompt_text`` with ``return_prompt_text``).
    """
    top_logprobs, with_token_ids = request.get("top_logprobs") or 0, bool(request.get("return_token_ids"))
    choices = []
    prompt_ids = None
    for choice in completion["choices"]:
        prompt_ids = choice.get("prompt_token_ids")
        choices.append(
            {
                "index": choice["index"],
                "message": {
                    "role": "assistant",
                    "content": choice["text"],
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": _chat_logprobs(choice["logprobs"], top_logprobs),
                "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"],
                "token_ids": choice["token_ids"] if with_token_ids else None,
                "routed_experts": None,
            }
        )
    # The completion's fields stay (its usage, fingerprint, created time and transfer fields); chat adds its own.
    return dict(
        completion,
        id=f"chatcmpl-{uuid.uuid4().hex}",
        object="chat.completion",
        choices=choices,
        prompt_logprobs=None,
        prompt_token_ids=prompt_ids if with_token_ids else None,
        prompt_text=prompt if request.get("return_prompt_text") else None,
    )


def _chat_logprobs(block: dict[str, Any] | None, k: int) -> dict[str, Any] | None:
    """Completion logprobs (parallel lists) as chat logprobs: one entry per token, with its top ``k``."""
    if block is None:
        return None
    content = []
    for token, value, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"]):
        alternatives = [
            {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            for text, logprob in list(top.items())[:k]
        ]
        content.append(
            {"token": token, "logprob": value, "bytes": list(token.encode("utf-8")), "top_logprobs": alternatives}
        )
    return {"content": content}
