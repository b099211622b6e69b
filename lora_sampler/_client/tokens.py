"""The engine's own tokenizer over HTTP: ``POST /tokenize`` (a text, or chat messages) and ``POST /detokenize``.

A harness that counts tokens (context windows, the context/continuation split of a log-likelihood) needs the
tokenizer the engine scores with; the engine has it, so asking it needs no tokenizer download. Each call goes through
the client's retry policy as a base-model request (there is no adapter to load before a retry: the tokenizer does
not depend on the adapter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from lora_sampler._transport.http import EngineTransport, new_id
from lora_sampler._wire.routes import DETOKENIZE_PATH, TOKENIZE_PATH
from lora_sampler.errors import EngineError
from lora_sampler.retry import RetryPolicy, make_retrying
from lora_sampler.types import Message


@dataclass
class _TokenizerCall:
    """One tokenizer request as the retry glue sees it (no text is logged from here)."""

    model: str
    path: str
    payload: Dict[str, Any]
    parse: Callable[[Any], Any]
    session_id: str
    is_adapter: bool = False
    started: float = field(default_factory=time.monotonic)


class EngineTokenizer:
    """Tokenizes and detokenizes with the engine's tokenizer, each request under the retry policy.

    Args:
        transport: The client's transport.
        policy: The client's retry policy.
    """

    def __init__(self, transport: EngineTransport, policy: RetryPolicy):
        self._retrying = make_retrying(policy, _Sender(transport).attempt, _nothing_to_prepare)

    def tokenize(
        self, text: str, model: str, *, add_special_tokens: bool, session_id: Optional[str] = None
    ) -> Tuple[int, ...]:
        """Return the engine's token ids of ``text`` (with the specials its tokenizer adds, if asked)."""
        payload = {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}
        tokens: Tuple[int, ...] = self._call(TOKENIZE_PATH, model, payload, _tokens_of, session_id)
        return tokens

    def tokenize_chat(
        self,
        messages: Sequence[Message],
        model: str,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        session_id: Optional[str] = None,
    ) -> Tuple[int, ...]:
        """Return the token ids of ``messages`` rendered by the engine's chat template (vLLM's chat ``/tokenize``)."""
        payload = {
            "model": model,
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        tokens: Tuple[int, ...] = self._call(TOKENIZE_PATH, model, payload, _tokens_of, session_id)
        return tokens

    def detokenize(self, tokens: Sequence[int], model: str, *, session_id: Optional[str] = None) -> str:
        """Return the text of ``tokens`` as the engine's tokenizer decodes them (special tokens kept as text)."""
        payload = {"model": model, "tokens": list(tokens)}
        text: str = self._call(DETOKENIZE_PATH, model, payload, _text_of, session_id)
        return text

    def _call(
        self, path: str, model: str, payload: Dict[str, Any], parse: Callable[[Any], Any], session: Optional[str]
    ) -> Any:
        return self._retrying(_TokenizerCall(model, path, payload, parse, session or new_id()))


class _Sender:
    """One attempt of a tokenizer call (kept apart from ``EngineTokenizer``, so its retry wrapper makes no cycle)."""

    def __init__(self, transport: EngineTransport):
        self._transport = transport

    def attempt(self, call: _TokenizerCall) -> Any:
        """Send exactly one tokenizer request."""
        return self._transport.post_json(
            call.path, call.payload, model=call.model, session_id=call.session_id, parse=call.parse
        )


def _nothing_to_prepare(call: _TokenizerCall, error: EngineError, attempt: int) -> None:
    """A tokenizer request names the base model: no adapter to load before its retry."""


def _tokens_of(body: Any) -> Tuple[int, ...]:
    """Read vLLM's ``/tokenize`` answer ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
        raise ValueError("it has no 'tokens' list of ints; is base_url a vLLM server?")
    return tuple(tokens)


def _text_of(body: Any) -> str:
    """Read vLLM's ``/detokenize`` answer ``{"prompt": str}``."""
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise ValueError("it has no 'prompt' string; is base_url a vLLM server?")
    return text
