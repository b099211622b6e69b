"""Value types: what a sample request holds, how it becomes a vLLM payload, and the outputs an answer becomes.

Frozen dataclasses with validation in ``__post_init__`` (bad arguments raise ``ValueError``/``TypeError``
naming the argument, before any request). No I/O here.

How results show is theirs too: a repr stays one short line whatever the answer holds (a list of 2,000 results stays
readable), numbers are rounded for reading only, and the plain-dict form (``to_dict``) holds every value exactly, in
JSON types (non-finite logprobs become None).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast, overload

from lora_sampler._views import json_number
from lora_sampler._wire import answers
from lora_sampler._wire.answers import MAX_LOGPROB as MAX_LOGPROB  # re-exported: a public name here
from lora_sampler._wire.answers import model_cards as model_cards  # re-exported: a public name here
from lora_sampler._wire.archives import ARCHIVE_SUFFIXES as ARCHIVE_SUFFIXES  # re-exported: a public name here
from lora_sampler._wire.archives import has_archive_suffix
from lora_sampler._wire.messages import SAMPLING_FIELDS, check_text, validated_extra_body, validated_messages

#: URL schemes of object stores whose objects and prefixes are checkpoint paths (see docs/guides/object-storage.md).
STORAGE_SCHEMES = ("s3", "gs", "gcs")

Prompt = Union[str, Sequence[int]]
#: One chat message: ``{"role": ..., "content": ...}`` (other keys, e.g. ``name``, are sent as given).
Message = Mapping[str, Any]
StopSpec = Union[None, str, int, Sequence[Union[str, int]]]
#: One position of top-k prompt logprobs: ``(token_id, logprob)`` pairs, best first.
TopK = Tuple[Tuple[int, float], ...]
#: A request timeout: ``(connect, read)`` seconds, or one number for both.
Timeout = Union[float, Tuple[float, float]]
#: Characters of generated text a repr shows, and of each sequence's text the notebook table shows.
REPR_TEXT_CHARS = 24
HTML_TEXT_CHARS = 200


def split_timeout(timeout: Timeout) -> Tuple[float, float]:
    """Return ``(connect, read)`` of a timeout given as a pair or as one number for both."""
    return timeout if isinstance(timeout, tuple) else (timeout, timeout)


def validated_timeout(timeout: object, argument: str = "timeout") -> Timeout:
    """Return ``timeout`` if it is seconds > 0 (one finite number, or a ``(connect, read)`` pair of them).

    Raises:
        TypeError, ValueError: anything else, naming the argument and the form it takes.
    """
    values = timeout if isinstance(timeout, tuple) else (timeout,)
    if len(values) not in (1, 2) or not all(_is_number(v) and 0 < v < math.inf for v in values):
        raise ValueError(
            f"{argument} takes seconds > 0: one number, or (connect, read) such as (10, 300); got {timeout!r}"
        )
    return cast(Timeout, timeout)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_count(argument: str, value: object, minimum: int, note: str = "") -> None:
    """Refuse ``value`` unless it is an int >= ``minimum`` (a bool is not one), naming the argument (``note``: what
    else it takes): the one rule of every count a caller passes, so each says it in the same words.

    Raises:
        ValueError: ``value`` is not such an int.
    """
    if not _is_int(value) or cast(int, value) < minimum:
        raise ValueError(f"{argument} must be an int >= {minimum}{note}, got {value!r}")


def checked_seconds(value: object, argument: str) -> float:
    """Return ``value`` as seconds if it is a finite or infinite number >= 0 (not NaN, not a bool): the one rule of
    every duration a caller passes (a wait, a delay, a hold), so each says it in the same words. A whole number
    beyond the float range (``10**400``) is ``inf``, as long a wait as any.

    Raises:
        ValueError: it is not such a number; the message names ``argument``.
    """
    if not _is_number(value) or not cast(float, value) >= 0:
        raise ValueError(f"{argument} must be a number of seconds >= 0, got {value!r}")
    return math.inf if cast(float, value) > sys.float_info.max else float(cast(float, value))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: sent as vLLM's completion parameters.

    Args:
        max_tokens: Tokens to generate, at least 1; None: as many as the context leaves (the client sends the
            engine's ``max_model_len``, which vLLM clamps to the room after the prompt), unless a stop ends it first.
        temperature: Sampling temperature, >= 0 (0 is greedy).
        top_p: Nucleus mass in (0, 1].
        top_k: Top-k cut-off; -1 (or 0) disables it.
        seed: Seed for reproducible samples, or None.
        stop: Stop strings (sent as vLLM's ``stop``) and/or stop token ids (sent as ``stop_token_ids``): a string,
            an int, or a sequence mixing both.
    """

    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: StopSpec = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_count("max_tokens", self.max_tokens, 1, " or None (no limit but the context)")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        check_count("top_k", self.top_k, -1, " (-1 disables it)")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))

    @property
    def stop_strings(self) -> Tuple[str, ...]:
        """The stop strings, in the order given."""
        return tuple(s for s in self._stop_items() if isinstance(s, str))

    @property
    def stop_token_ids(self) -> Tuple[int, ...]:
        """The stop token ids, in the order given."""
        return tuple(s for s in self._stop_items() if not isinstance(s, str))

    def _stop_items(self) -> Tuple[Union[str, int], ...]:
        # __post_init__ normalised ``stop`` to a tuple (or None).
        return cast(Tuple[Union[str, int], ...], self.stop or ())

    def to_payload(self) -> Dict[str, Any]:
        """Return the vLLM completion fields for these parameters (nothing set is dropped)."""
        payload = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        if self.seed is None:
            del payload["seed"]
        strings, ids = self.stop_strings, self.stop_token_ids
        if strings:
            payload["stop"] = list(strings)
        if ids:
            payload["stop_token_ids"] = list(ids)
        return payload


def _normalise_stop(stop: object) -> Optional[Tuple[Union[str, int], ...]]:
    if stop is None:
        return None
    items = (stop,) if isinstance(stop, (str, int)) else stop
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop must be a str, an int, or a list of them, got {type(stop).__name__}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise TypeError(f"stop entries must be str (stop strings) or int (stop token ids), got {item!r}")
        if isinstance(item, int) and item < 0:
            raise ValueError(f"stop token ids must be >= 0, got {item}")
    return tuple(items) or None


DEFAULT_SAMPLING_PARAMS = SamplingParams()


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter the engine can serve by ``name``.

    Attributes:
        name: The model name to request (the folder name in the resolver directory).
        path: The adapter folder as this machine sees it, when known.
        digest: Content digest of the checkpoint it was published from, when published by lora_sampler.
        source: The checkpoint it was published from, when published by lora_sampler.
    """

    name: str
    path: Optional[str] = None
    digest: Optional[str] = None
    source: Optional[str] = None


AdapterSpec = Union[Adapter, str, "os.PathLike[str]"]


def is_storage_url(value: object) -> bool:
    """Tell whether a checkpoint path is an object-store URL (``s3://bucket/key``, ``gs://bucket/key``)."""
    if not isinstance(value, str):
        return False
    scheme, separator, rest = value.partition("://")
    return bool(separator) and bool(rest) and scheme.lower() in STORAGE_SCHEMES


def is_checkpoint_path(adapter: object) -> bool:
    """Tell whether an ``adapter=`` value names a checkpoint (on disk or in storage) rather than an adapter name."""
    if isinstance(adapter, os.PathLike):
        return True
    if not isinstance(adapter, str):
        return False
    return is_storage_url(adapter) or os.sep in adapter or "/" in adapter or has_archive_suffix(adapter)


@dataclass(frozen=True)
class SampleRequest:
    """The arguments of one ``SamplerClient.sample`` (``prompt=``) or ``chat`` (``messages=``) call, validated.

    Args:
        prompt: Token ids (a list of ints >= 0) or text, for ``/v1/completions``; exclusive with ``messages``.
        adapter: An ``Adapter``, a checkpoint path, or an adapter name; exclusive with ``base_model``.
        base_model: The engine's base model name; exclusive with ``adapter``.
        num_samples: Completions to draw for the prompt (vLLM's ``n``), at least 1.
        sampling_params: ``SamplingParams``; None means the defaults.
        prompt_logprobs: Also return the logprob of each prompt token (``prompt=`` requests only).
        topk_prompt_logprobs: Also return the top-k logprobs at each prompt position (implies prompt_logprobs).
        session_id: Sent as ``X-Session-ID`` (the key vLLM routers hash); a fresh one per call when None.
        messages: Chat messages (``{"role", "content"}`` mappings), for ``/v1/chat/completions``; exclusive with
            ``prompt``. The engine applies the model's chat template.
        extra_body: Further body fields sent as given (vLLM's extra parameters, e.g. ``repetition_penalty``); a
            field this request sets itself (``_messages.OWN_FIELDS``) is refused.
        timeout: ``(connect, read)`` seconds (or one number for both) for this request's attempts, in place of the
            client's ``timeout``; None keeps the client's.
        topk_sample_logprobs: Also return the top-k ``(token_id, logprob)`` pairs at each generated position
            (``prompt=`` requests only; vLLM serves at most its ``--max-logprobs``, 20 by default).
    """

    prompt: Optional[Prompt] = None
    adapter: Optional[AdapterSpec] = None
    base_model: Optional[str] = None
    num_samples: int = 1
    sampling_params: Optional[SamplingParams] = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    session_id: Optional[str] = None
    messages: Optional[Sequence[Message]] = None
    extra_body: Optional[Mapping[str, Any]] = None
    timeout: Optional[Timeout] = None
    topk_sample_logprobs: int = 0

    def __post_init__(self) -> None:
        _check_model_choice(self.adapter, self.base_model)
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of prompt= (token ids or text) or messages= (chat messages)")
        if self.messages is not None:
            object.__setattr__(self, "messages", validated_messages(self.messages))
            if self.prompt_logprobs or self.topk_prompt_logprobs or self.topk_sample_logprobs:
                raise ValueError(
                    "prompt_logprobs, topk_prompt_logprobs and topk_sample_logprobs apply to prompt= requests, not to "
                    "chat"
                )
        else:
            object.__setattr__(self, "prompt", _validated_prompt(self.prompt))
        check_count("num_samples", self.num_samples, 1)
        if self.sampling_params is not None and not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(self.sampling_params).__name__}")
        check_count("topk_prompt_logprobs", self.topk_prompt_logprobs, 0)
        check_count("topk_sample_logprobs", self.topk_sample_logprobs, 0)
        _check_session_id(self.session_id)
        if self.extra_body is not None:
            object.__setattr__(self, "extra_body", validated_extra_body(self.extra_body))
        if self.timeout is not None:
            object.__setattr__(self, "timeout", validated_timeout(self.timeout))

    @property
    def is_chat(self) -> bool:
        """Whether this is a chat request (``messages=``, sent to ``/v1/chat/completions``)."""
        return self.messages is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the engine must compute prompt logprobs for this request."""
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0

    def to_payload(self, model: str) -> Dict[str, Any]:
        """Return the JSON body of ``POST /v1/completions`` (or ``/v1/chat/completions``) against ``model``."""
        params = self.sampling_params or DEFAULT_SAMPLING_PARAMS
        payload: Dict[str, Any] = {"model": model, **(self.extra_body or {})}
        if self.messages is not None:
            payload["messages"] = [dict(message) for message in self.messages]
        else:
            payload["prompt"] = self.prompt if isinstance(self.prompt, str) else list(cast(Sequence[int], self.prompt))
        payload.update(
            n=self.num_samples,
            **params.to_payload(),
            # Completions: logprobs=1 returns the sampled token's logprob (verified on vLLM); chat
            # takes a flag, and top_logprobs (0 by default) for alternatives.
            logprobs=True if self.messages is not None else max(1, self.topk_sample_logprobs),
            return_token_ids=True,
        )
        if self.topk_sample_logprobs:  # the alternatives keyed "token_id:<id>" rather than by their (ambiguous) text
            payload["return_tokens_as_token_ids"] = True
        if self.wants_prompt_logprobs:
            payload["prompt_logprobs"] = self.topk_prompt_logprobs
        return payload


def _check_model_choice(adapter: object, base_model: object) -> None:
    """Check the ``adapter=`` / ``base_model=`` pair of a request: exactly one, of the right kind."""
    if (adapter is None) == (base_model is None):
        raise ValueError("pass exactly one of adapter= (a LoRA adapter) or base_model= (the engine's model)")
    if adapter is not None and not isinstance(adapter, (Adapter, str, os.PathLike)):
        raise TypeError(f"adapter must be an Adapter, a checkpoint path or a name, got {type(adapter)}")
    if isinstance(adapter, str) and not adapter.strip():
        raise ValueError("adapter must not be empty")
    if base_model is not None and (not isinstance(base_model, str) or not base_model):
        raise TypeError(f"base_model must be a non-empty str, got {base_model!r}")


def _check_session_id(session_id: object) -> None:
    if session_id is not None and not isinstance(session_id, str):
        raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")


_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(SampleRequest)) - {"prompt"}
#: Keyword arguments of ``sample``/``chat``/``submit`` (and keys of request mappings) that build a ``SamplingParams``.
SAMPLING_KEYWORDS = (*SAMPLING_FIELDS, "stop")


#: Keyword arguments the OpenAI SDK and vLLM users reach for, and what this client takes instead.
HABIT_HINTS = {
    "n": "num_samples= (the OpenAI SDK's n)",
    "model": "adapter= (a LoRA adapter: an Adapter, a checkpoint path or an adapter name) or base_model= (the "
    "engine's own model)",
    "lora_request": "adapter= (an Adapter, a checkpoint path or an adapter name)",
    "max_completion_tokens": "max_tokens=",
    "stop_token_ids": "stop= (token ids and strings alike)",
    "messages": "client.chat(messages, ...) for chat messages (sample takes a prompt: token ids or text)",
}


def habit_error(function: str, unknown: Iterable[str]) -> TypeError:
    """Return the ``TypeError`` of a call with keyword arguments ``function`` does not take, with the hint for each
    one another library spells that way (``n=`` is ``num_samples=``, ``model=`` is ``adapter=``/``base_model=``)."""
    names = sorted(unknown)
    plural = "an unexpected keyword argument" if len(names) == 1 else "unexpected keyword arguments"
    return TypeError(f"{function}() got {plural} {_hinted(names)}")


def _hinted(names: Sequence[str]) -> str:
    """Name each unknown keyword, with the hint for it when another library spells it that way (``HABIT_HINTS``)."""
    return "; ".join(f"{name!r}" + (f": use {HABIT_HINTS[name]}" if name in HABIT_HINTS else "") for name in names)


def sampling_params_from(sampling_params: Optional[SamplingParams], **keywords: Any) -> Optional[SamplingParams]:
    """Return ``sampling_params``, or the ``SamplingParams`` of sampling keywords (``max_tokens=``, ...).

    A keyword that is None leaves its field at the default; ``sampling_params`` alone (or None) is returned as is.

    Raises:
        TypeError: sampling keywords given together with ``sampling_params=``.
    """
    given = {name: value for name, value in keywords.items() if value is not None}
    if not given:
        return sampling_params
    if sampling_params is not None:
        raise TypeError(
            f"pass sampling fields either as sampling_params=SamplingParams(...) or as keyword arguments "
            f"({', '.join(sorted(given))}=...), not both"
        )
    return SamplingParams(**given)


def build_request(prompt: Optional[Prompt] = None, **fields: Any) -> SampleRequest:
    """Return the ``SampleRequest`` of ``fields``, where sampling fields may come as keyword arguments.

    ``max_tokens=``, ``temperature=``, ``top_p=``, ``top_k=``, ``seed=`` and ``stop=`` (the OpenAI SDK's habit)
    build the ``SamplingParams``; None leaves a field at its default.

    Raises:
        TypeError: sampling keywords given together with ``sampling_params=``, or an unknown field.
    """
    given = {name: fields.pop(name) for name in SAMPLING_KEYWORDS if name in fields}
    fields["sampling_params"] = sampling_params_from(fields.get("sampling_params"), **given)
    unknown = sorted(set(fields) - _REQUEST_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown request field(s) {_hinted(unknown)}; a request takes "
            f"{', '.join(sorted(_REQUEST_FIELDS))} and the sampling fields {', '.join(SAMPLING_KEYWORDS)} (vLLM's "
            "other body fields go in extra_body=)"
        )
    return SampleRequest(prompt, **fields)


#: Token ids are below this: vLLM holds them as 32-bit ints (a larger one would be sent on and wrap or fail there).
TOKEN_ID_LIMIT = 2**31
_INT_TYPE = {int}


def _validated_prompt(prompt: object, what: str = "prompt") -> Prompt:
    """Return ``prompt`` as text or a tuple of token ids, or raise naming what is wrong with it and the fix."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what} must not be empty")
        check_text(prompt, what)
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{what} must be a list of token ids or a str, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError(f"{what} must not be empty")
    return _validated_token_ids(prompt, what)


def _validated_token_ids(prompt: Union[List[Any], Tuple[Any, ...]], what: str) -> Tuple[int, ...]:
    """Return a non-empty list of token ids as a tuple, or raise naming the first id that is not one."""
    if not set(map(type, prompt)) <= _INT_TYPE:  # one C loop for the usual case; the slow one names the culprit
        _check_token_types(prompt, what)
    if min(prompt) < 0 or max(prompt) >= TOKEN_ID_LIMIT:
        position, token = next((i, token) for i, token in enumerate(prompt) if not 0 <= token < TOKEN_ID_LIMIT)
        if token < 0:
            raise ValueError(f"{what} token ids must be >= 0, got {token} at position {position}")
        raise ValueError(
            f"{what} token ids must be below 2**31 (vLLM holds token ids as 32-bit ints, and no vocabulary comes "
            f"near), got {token} at position {position}; pass the tokenizer's ids"
        )
    return tuple(prompt)


def _check_token_types(prompt: Sequence[Any], what: str) -> None:
    """Refuse a token-id list holding anything but ints, naming the first such item (or chat messages, and the fix)."""
    if all(isinstance(item, Mapping) and "role" in item for item in prompt):
        raise TypeError(
            f"{what} holds chat messages ({{'role', 'content'}} dicts), not token ids or text: use "
            "client.chat(messages, ...) (or messages= in a request) to sample a chat reply"
        )
    for position, token in enumerate(prompt):
        if not _is_int(token):
            raise TypeError(f"{what} token ids must be ints, got {token!r} at position {position}")


@dataclass(frozen=True)
class ScoreRequest:
    """The arguments of one scoring call: the logprob of each given token under an adapter or the base model.

    Args:
        prompt: Token ids or text. Without ``completion``, its own tokens are scored, each given those before it.
        completion: Token ids or text scored after ``prompt`` (each completion token given the prompt and the
            completion tokens before it); text is tokenized by the engine (``POST /tokenize``, no special tokens).
        adapter: An ``Adapter``, a checkpoint path, or an adapter name; exclusive with ``base_model``.
        base_model: The engine's base model name; exclusive with ``adapter``.
        session_id: Sent as ``X-Session-ID`` with every request of the call (router affinity).
    """

    prompt: Prompt
    completion: Optional[Prompt] = None
    adapter: Optional[AdapterSpec] = None
    base_model: Optional[str] = None
    session_id: Optional[str] = None

    def __post_init__(self) -> None:
        _check_model_choice(self.adapter, self.base_model)
        object.__setattr__(self, "prompt", _validated_prompt(self.prompt))
        if self.completion is not None:
            object.__setattr__(self, "completion", _validated_prompt(self.completion, "completion"))
        _check_session_id(self.session_id)


@dataclass(frozen=True)
class ScoreOutput:
    """The answer to one ``ScoreRequest``.

    Attributes:
        tokens: Every token of the scored sequence: the prompt's, then the completion's (the engine's for text).
        logprobs: One per token, each given the tokens before it; None for the first.
        start: Where the scored tokens begin: the completion's first token, or 1 without a completion.
        model: The model name that served it.
    """

    tokens: Tuple[int, ...]
    logprobs: Tuple[Optional[float], ...]
    start: int
    model: str = ""

    @property
    def scored_tokens(self) -> Tuple[int, ...]:
        """The tokens scored: the completion's, or the prompt's after the first."""
        return self.tokens[self.start :]

    @property
    def scored_logprobs(self) -> Tuple[float, ...]:
        """The logprobs of ``scored_tokens`` (numbers: only the sequence's first token has none)."""
        return cast(Tuple[float, ...], self.logprobs[self.start :])

    @property
    def total(self) -> float:
        """The sum of ``scored_logprobs``: the log-likelihood of the scored tokens (0.0 for none).

        A sum below the float range (logprobs such as -1e308) is ``-inf``, never an ``OverflowError``.
        """
        return _summed(self.scored_logprobs, skip_nan=False)


@dataclass(frozen=True)
class GeneratedSequence:
    """One completion.

    Attributes:
        tokens: Generated token ids.
        logprobs: Logprob of each generated token.
        stop_reason: Why generation ended: ``"stop"`` (a stop string, stop token or EOS) or ``"length"``.
        text: The decoded text.
        matched_stop: The stop string or token id that ended it (vLLM's ``stop_reason``), or None.
        topk_logprobs: The top-k ``(token_id, logprob)`` pairs at each generated position, best first, when
            ``topk_sample_logprobs`` asked for them; else None.
    """

    tokens: Tuple[int, ...]
    logprobs: Tuple[float, ...]
    stop_reason: str
    text: str = ""
    matched_stop: Union[str, int, None] = None
    topk_logprobs: Optional[Tuple[TopK, ...]] = None

    def __repr__(self) -> str:
        """One line: token count, stop reason, summed logprob (2 decimals) and the start of the text."""
        return (
            f"GeneratedSequence(tokens={len(self.tokens)}, stop_reason={self.stop_reason!r}, "
            f"logprob={_summed(self.logprobs):.2f}, text={_short(self.text, REPR_TEXT_CHARS)!r})"
        )

    def to_dict(self) -> Dict[str, Any]:
        """Return the plain-dict form (JSON types; a non-finite logprob becomes None): every token id and logprob, the
        text and why it stopped."""
        shown = {
            "tokens": list(self.tokens),
            "logprobs": _numbers(self.logprobs),
            "text": self.text,
            "stop_reason": self.stop_reason,
            "matched_stop": self.matched_stop,
        }
        if self.topk_logprobs is not None:
            shown["topk_logprobs"] = [_pairs(entry) for entry in self.topk_logprobs]
        return shown


@dataclass(frozen=True)
class Usage:
    """Token counts of one answer, as the engine reported them (the OpenAI SDK's ``usage``).

    Attributes:
        prompt_tokens: Tokens of the prompt (the rendered chat for ``chat``).
        completion_tokens: Tokens generated, over all sequences.
        total_tokens: Their sum.
        cached_tokens: Prompt tokens served from the engine's prefix cache, when it reports them (vLLM's
            ``usage.prompt_tokens_details.cached_tokens``, sent with ``--enable-prompt-tokens-details``); else None.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: Optional[int] = None

    @classmethod
    def from_body(cls, body: Optional[Mapping[str, Any]]) -> Optional[Usage]:
        """Read the ``usage`` object of an answer; None when the answer has none."""
        counts = answers.usage_of(body)
        return None if counts is None else cls(*counts)

    def to_dict(self) -> Dict[str, int]:
        """Return the counts as a plain dict (``cached_tokens`` only when the engine reported it)."""
        return {name: count for name, count in vars(self).items() if count is not None}


@dataclass(frozen=True)
class SampleOutput:
    """The answer to one sample request.

    Attributes:
        sequences: The ``num_samples`` completions.
        prompt_logprobs: Logprob of each prompt token (None for the first), when asked.
        topk_prompt_logprobs: Top-k ``(token_id, logprob)`` pairs at each prompt position (None for the first),
            trimmed to k, when asked: a ``PromptTopK`` view that reads each position from the answer when accessed.
        model: The model name that served it.
        body: The engine's answer as it came (the JSON object), e.g. for the usage counts or the chat template's
            ``prompt_token_ids``; the batch file format writes it as ``response.body``.
    """

    sequences: Tuple[GeneratedSequence, ...]
    prompt_logprobs: Optional[Tuple[Optional[float], ...]] = None
    topk_prompt_logprobs: Optional[Sequence[Optional[TopK]]] = None
    model: str = field(default="")
    body: Optional[Dict[str, Any]] = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: model, number of sequences, their token counts and stop reasons, the start of the first text."""
        sequences = self.sequences
        stops = "/".join(sorted({s.stop_reason for s in sequences})) or "-"
        text = _short(sequences[0].text, REPR_TEXT_CHARS) if sequences else ""
        extra = ", prompt_logprobs" if self.prompt_logprobs is not None else ""
        return (
            f"SampleOutput(model={self.model!r}, n={len(sequences)}, tokens={_span(len(s.tokens) for s in sequences)}, "
            f"stop={stops}{extra}, text={text!r})"
        )

    def _repr_html_(self) -> str:
        """The notebook display: one table row per sequence (tokens, stop reason, summed logprob, text)."""
        usage = self.usage
        counts = f"; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else ""
        rows = "".join(
            f"<tr><td>{i}</td><td>{len(s.tokens)}</td><td>{html.escape(s.stop_reason)}</td>"
            f"<td>{_summed(s.logprobs):.2f}</td>"
            f"<td style='text-align:left'>{html.escape(_short(s.text, HTML_TEXT_CHARS))}</td></tr>"
            for i, s in enumerate(self.sequences)
        )
        return (
            f"<div><b>SampleOutput</b> from <code>{html.escape(self.model)}</code>: {len(self.sequences)} "
            f"sequence(s){html.escape(counts)}<table><tr><th>#</th><th>tokens</th><th>stop</th><th>logprob</th>"
            f"<th>text</th></tr>{rows}</table></div>"
        )

    @property
    def usage(self) -> Optional[Usage]:
        """The engine's token counts for this answer (``prompt_tokens``, ``completion_tokens``, ``total_tokens``)."""
        return Usage.from_body(self.body)

    def to_dict(self) -> Dict[str, Any]:
        """Return every value in plain JSON types: model, sequences, prompt logprobs, top-k and usage (not ``body``)."""
        usage, topk = self.usage, self.topk_prompt_logprobs
        return {
            "model": self.model,
            "sequences": [sequence.to_dict() for sequence in self.sequences],
            "prompt_logprobs": None if self.prompt_logprobs is None else _numbers(self.prompt_logprobs),
            "topk_prompt_logprobs": None if topk is None else [None if e is None else _pairs(e) for e in topk],
            "usage": None if usage is None else usage.to_dict(),
        }

    def to_json(self, **dumps_options: Any) -> str:
        """Return ``to_dict()`` as strict JSON (``json.dumps`` options, e.g. ``indent=2``, pass through)."""
        return json.dumps(self.to_dict(), allow_nan=False, **dumps_options)

    @classmethod
    def from_json(cls, body: Any, request: SampleRequest, *, model: Optional[str] = None) -> SampleOutput:
        """Read a vLLM ``/v1/completions`` or ``/v1/chat/completions`` body, checking it is the exact answer asked for.

        Args:
            body: The decoded JSON answer.
            request: The request it answers.
            model: The model name requested; when given, the answer must name the same model (an adapter that
                was silently not applied answers as the base model).

        Raises:
            ValueError: the body is not exactly the answer: not ``num_samples`` choices, a choice without token
                ids or their logprobs, prompt logprobs missing when asked, or another model.
        """
        choices = answers.choices_of(body, request.num_samples, model)
        topk_samples = request.topk_sample_logprobs
        sequences = tuple(GeneratedSequence(**answers.sequence_fields(choice, topk_samples)) for choice in choices)
        prompt_lp, topk = None, None
        if request.wants_prompt_logprobs:
            prompt_lp, raw = answers.prompt_logprobs_of(choices[0], request.prompt, request.prompt_logprobs)
            topk = PromptTopK(raw, request.topk_prompt_logprobs) if request.topk_prompt_logprobs else None
        return cls(sequences, prompt_lp, topk, str(body.get("model") or ""), body)


def _summed(logprobs: Sequence[float], skip_nan: bool = True) -> float:
    """The sum of logprobs; one below the float range is ``-inf``, never an ``OverflowError``.

    A display leaves NaN entries (sent as null) out (``skip_nan``); a score's total keeps them, so a NaN the engine
    sent shows in the total instead of vanishing from it.
    """
    numbers = [lp for lp in logprobs if not (skip_nan and math.isnan(lp))]
    try:
        return math.fsum(numbers)
    except OverflowError:  # fsum's exact intermediate left the float range: the plain sum is the infinity
        return sum(numbers)


def _numbers(values: Sequence[Optional[float]]) -> List[Optional[float]]:
    return [json_number(value) for value in values]


def _pairs(entry: Sequence[Tuple[int, float]]) -> List[List[Any]]:
    """Top-k ``(token_id, logprob)`` pairs in JSON types."""
    return [[token_id, json_number(logprob)] for token_id, logprob in entry]


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _span(values: Iterable[int]) -> str:
    """``16`` when all equal, else ``12-16``."""
    found = sorted(set(values))
    if not found:
        return "0"
    return str(found[0]) if len(found) == 1 else f"{found[0]}-{found[-1]}"


def prompt_list(requests: Sequence[SampleRequest]) -> List[Union[str, List[int]]]:
    """Return the ``prompt`` field of one request carrying the prompts of ``requests`` (texts or token-id lists)."""
    return [
        request.prompt if isinstance(request.prompt, str) else list(cast(Sequence[int], request.prompt))
        for request in requests
    ]


def outputs_from_batch(
    body: Any, requests: Sequence[SampleRequest], *, model: Optional[str] = None
) -> List[Union[SampleOutput, ValueError]]:
    """Split vLLM's answer to a list of prompts into one ``SampleOutput`` per request, in the order sent.

    vLLM numbers the choices over the whole request, prompt by prompt (``n`` each). Each output's ``body`` is the
    answer as one request for that prompt alone would have had it: its own choices (indices from 0) and a ``usage``
    counting its own tokens (the prompt's tokens, from the ``prompt_token_ids`` the engine sent or the ids given,
    and the tokens generated in its choices), since vLLM's ``usage`` sums the whole request; that sum stays under
    ``request_usage``. Without the prompt's token count (a text prompt answered without ``prompt_token_ids``) the
    output has no ``usage``.

    Returns:
        Per request, its output, or the ``ValueError`` saying why its part of the answer does not fit.

    Raises:
        ValueError: the answer as a whole does not fit: another model, not ``n`` choices per prompt, choice indices
            that are not each number once, or choices lacking the prompt token ids asked for or echoing other ones
            than their token-id prompt was sent (the engine's answers could not be told apart, so none is used).
    """
    prompts = [cast(Prompt, request.prompt) for request in requests]
    parts = answers.prompt_parts(body, prompts, requests[0].num_samples, model)
    outputs: List[Union[SampleOutput, ValueError]] = []
    for number, (request, part) in enumerate(zip(requests, parts)):
        try:
            outputs.append(SampleOutput.from_json(part, request))
        except ValueError as problem:
            outputs.append(ValueError(f"prompt {number} of {len(requests)}: {problem}"))
    return outputs


_UNREAD: Any = object()


class PromptTopK(Sequence[Optional[TopK]]):
    """The top-k ``(token_id, logprob)`` pairs at each prompt position (None for the first), best first.

    A read-only sequence over the engine's answer: each position is read (ranked, trimmed to k, converted) the first
    time it is accessed, then kept. Decoding a scoring answer thus costs no more than the positions a caller reads.
    It compares equal to a tuple or list of the same pairs; a malformed position raises ``ValueError`` when read.
    """

    __slots__ = ("_k", "_raw", "_read")

    def __init__(self, raw: Sequence[Optional[Dict[str, Dict[str, Any]]]], k: int):
        self._raw, self._k = raw, k
        self._read: Optional[List[Any]] = None

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, index: int) -> Optional[TopK]: ...

    @overload
    def __getitem__(self, index: slice) -> Tuple[Optional[TopK], ...]: ...

    def __getitem__(self, index: Union[int, slice]) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self._raw))))
        if self._read is None:
            self._read = [_UNREAD] * len(self._raw)
        value = self._read[index]
        if value is _UNREAD:
            value = self._read[index] = self._position(index)
        return value

    def _position(self, index: int) -> Optional[TopK]:
        try:
            return answers.ranked(self._raw[index], self._k)
        except (TypeError, LookupError, AttributeError, ValueError, OverflowError) as exc:
            raise ValueError(f"the engine's prompt logprobs at position {index} are malformed: {exc!r}") from None

    def __iter__(self) -> Iterator[Optional[TopK]]:
        return (self[i] for i in range(len(self._raw)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PromptTopK, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> Tuple[Any, ...]:
        return PromptTopK, (self._raw, self._k)
