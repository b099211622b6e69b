"""How vLLM answers: model cards, the tokenizer's answers, a completion's choices, a prompt list's answers per
prompt, usage, logprobs.

Reads decoded JSON into plain Python data and checks it is exactly the answer asked for; anything else is a
``ValueError`` saying what does not fit. It knows no value type: ``lora_sampler.types`` builds its values
(``SampleOutput``, ``GeneratedSequence``, ``PromptTopK``) from what is read here. Pure, no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

#: A prompt as sent: text, or token ids.
SentPrompt = Union[str, Sequence[int]]
#: One position of top-k prompt logprobs: ``(token_id, logprob)`` pairs, best first.
TopKPairs = Tuple[Tuple[int, float], ...]

_DICT_TYPE = {dict}
_INT_TYPE = {int}
_NONE_TYPE = type(None)
_LOGPROB_TYPES = {float, int, _NONE_TYPE}
_ENTRY_TYPES = {dict, _NONE_TYPE}
_NUMBER_TYPES = (int, float)
_INFINITY = float("inf")
#: The largest logprob accepted: 0 plus room for float rounding in the engine's log-softmax.
MAX_LOGPROB = 1e-3


def model_cards(body: Any) -> List[Dict[str, Any]]:
    """Return the model cards of a ``GET /v1/models`` body (base models, and adapters with a ``parent``).

    Raises:
        ValueError: the body has no ``data`` list of cards with an ``id`` each.
    """
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list) or not all(isinstance(card, dict) and "id" in card for card in cards):
        raise ValueError("it has no 'data' list of model cards with an 'id' each")
    return cards


def tokens_of(body: Any) -> Tuple[int, ...]:
    """Read vLLM's ``/tokenize`` answer ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= _INT_TYPE:
        raise ValueError("it has no 'tokens' list of ints; is base_url a vLLM server?")
    return tuple(tokens)


def text_of(body: Any) -> str:
    """Read vLLM's ``/detokenize`` answer ``{"prompt": str}``."""
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise ValueError("it has no 'prompt' string; is base_url a vLLM server?")
    return text


def prompt_parts(
    body: Any, prompts: Sequence[SentPrompt], num_samples: int, model: Optional[str]
) -> List[Dict[str, Any]]:
    """Split vLLM's answer to a list of prompts into one answer body per prompt, in the order sent.

    vLLM numbers the choices over the whole request, prompt by prompt (``n`` each). Each part is the answer as one
    request for that prompt alone would have had it: its own choices (indices from 0) and a ``usage`` counting its
    own tokens (None without the prompt's token count); vLLM's ``usage`` of the whole request is its
    ``request_usage``.

    Raises:
        ValueError: the answer as a whole does not fit: another model, not ``n`` choices per prompt, choice indices
            that are not each number once, or choices whose echo does not fit their prompt (``_check_echo``).
    """
    choices = model_choices(body, model)
    n = num_samples
    if len(choices) != n * len(prompts):
        raise ValueError(
            f"it holds {len(choices)} choices where {len(prompts)} prompts of num_samples={n} each were sent; "
            "the answers cannot be matched to their prompts, so none is used. An engine or proxy that does not answer "
            "prompt lists needs one prompt a request: prompts_per_request=1 (--prompts-per-request 1)"
        )
    choices = _in_index_order(choices, [choice.get("index") for choice in choices])
    shared = {key: value for key, value in body.items() if key not in ("choices", "usage")}
    shared["request_usage"] = body.get("usage")
    parts: List[Dict[str, Any]] = []
    for number, prompt in enumerate(prompts):
        own = [dict(choice, index=index) for index, choice in enumerate(choices[number * n : (number + 1) * n])]
        _check_echo(own, prompt, number)
        parts.append(dict(shared, choices=own, usage=_own_usage(own, prompt)))
    return parts


def _check_echo(choices: List[Dict[str, Any]], prompt: SentPrompt, number: int) -> None:
    """Refuse the choices in place of prompt ``number`` of a prompt list that cannot be told to answer it.

    The index alone cannot tell mixed-up answers apart, so every choice must carry the echo asked for
    (``return_token_ids``); a token-id prompt's choices must echo the ids it was sent, and a text prompt's choices
    one token list (its text is not tokenized here, so that is all a text prompt is checked for beyond its index).
    """
    echoes = [choice.get("prompt_token_ids") for choice in choices]
    if any(echo is None for echo in echoes):
        raise ValueError(
            f"the choices in place of prompt {number} do not echo their prompt token ids (asked for with "
            "return_token_ids), so the answers cannot be matched to their prompts; none is used"
        )
    if isinstance(prompt, str):
        if any(echo != echoes[0] for echo in echoes):
            raise ValueError(f"the choices in place of text prompt {number} echo different token ids; none is used")
        return
    if any(echo != list(prompt) for echo in echoes):
        raise ValueError(
            f"the choices in place of prompt {number} echo other prompt token ids than it was sent; the answers "
            "cannot be matched to their prompts, so none is used"
        )


def usage_of(body: Any) -> Optional[Tuple[int, int, int, Optional[int]]]:
    """Read an answer's ``usage``: prompt, completion and total tokens (an absent count is 0, an absent total their
    sum), and the prompt tokens served from the prefix cache when reported (``prompt_tokens_details.cached_tokens``,
    else None); None when the answer has no usage, or one whose counts are not whole numbers >= 0."""
    usage = body.get("usage") if isinstance(body, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    prompt, completion, total = (usage.get(key) or 0 for key in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if not all(map(_is_count, (prompt, completion, total))):
        return None
    details = usage.get("prompt_tokens_details")
    reported = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return prompt, completion, total or prompt + completion, reported if _is_count(reported) else None


def _is_count(value: Any) -> bool:
    """Tell whether ``value`` is a token count: an int >= 0 (not a bool)."""
    return type(value) is int and value >= 0


def _own_usage(choices: List[Dict[str, Any]], prompt: SentPrompt) -> Optional[Dict[str, int]]:
    """Return one prompt's token counts from its own choices (None when its prompt's length is unknown)."""
    echoed = choices[0].get("prompt_token_ids") if choices else None
    if isinstance(echoed, list):
        prompt_tokens = len(echoed)
    elif isinstance(prompt, str):
        return None
    else:
        prompt_tokens = len(prompt)
    generated = [choice.get("token_ids") for choice in choices]
    completion_tokens = sum(len(ids) for ids in generated if isinstance(ids, list))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_choices(body: Any, model: Optional[str]) -> List[Dict[str, Any]]:
    """Return an answer's ``choices``, once it is checked to be a completion object for the requested model whose
    choices are a list of objects (one request's answer or a prompt list's)."""
    if not isinstance(body, dict):
        raise ValueError(f"it is a JSON {type(body).__name__}, not a completion object")
    answered = body.get("model")
    if model is not None and answered != model:
        raise ValueError(
            f"it answers for model {answered!r}, not the requested {model!r} (an adapter silently not applied, "
            "or a proxy that fell back to another model)"
        )
    choices = body.get("choices")
    if not isinstance(choices, list) or not set(map(type, choices)) <= _DICT_TYPE:
        raise ValueError("it has no 'choices' list of objects; is base_url a vLLM server?")
    return choices


def choices_of(body: Any, num_samples: int, model: Optional[str]) -> List[Dict[str, Any]]:
    """Return an answer's choices in index order, once it is checked to be the requested model's ``n`` choices."""
    choices = model_choices(body, model)
    if len(choices) != num_samples:
        raise ValueError(f"it holds {len(choices)} choices where num_samples={num_samples} were asked")
    return _in_index_order(choices, [choice.get("index", position) for position, choice in enumerate(choices)])


def _in_index_order(choices: List[Dict[str, Any]], indices: List[Any]) -> List[Dict[str, Any]]:
    """Return ``choices`` ordered by their ``indices``, once those are checked to number them 0..N-1 once each."""
    expected = list(range(len(choices)))
    if indices == expected:
        return choices
    if not set(map(type, indices)) <= _INT_TYPE or sorted(indices) != expected:
        raise ValueError(f"its choice indices are not 0..{len(choices) - 1} once each")
    return [choices[position] for position in sorted(expected, key=indices.__getitem__)]


def prompt_logprobs_of(
    first: Dict[str, Any], prompt: Optional[SentPrompt], own_logprobs: bool
) -> Tuple[Optional[Tuple[Optional[float], ...]], List[Optional[Dict[str, Any]]]]:
    """Read the prompt logprobs asked for from the first choice: each token's own (with ``own_logprobs``), and the
    raw per-position entries a top-k view reads."""
    raw = first.get("prompt_logprobs")
    if not isinstance(raw, list) or not set(map(type, raw)) <= _ENTRY_TYPES:
        raise ValueError("prompt logprobs were asked for, but its first choice has no 'prompt_logprobs' list")
    prompt_ids = _prompt_ids(first, None if prompt is None or isinstance(prompt, str) else prompt)
    if prompt_ids is not None and len(raw) != len(prompt_ids):
        raise ValueError(f"it has {len(raw)} prompt logprobs for {len(prompt_ids)} prompt tokens")
    return (_actual_logprobs(raw, prompt_ids) if own_logprobs else None), raw


def _prompt_ids(first: Dict[str, Any], sent_ids: Optional[Sequence[int]]) -> Optional[Sequence[int]]:
    """Return the prompt's token ids: the echo (which must be the ids sent, if ids were sent), else the ids sent."""
    prompt_ids = first.get("prompt_token_ids") or sent_ids
    if prompt_ids is None:
        return None
    if not isinstance(prompt_ids, (list, tuple)) or not set(map(type, prompt_ids)) <= _INT_TYPE:
        raise ValueError("its 'prompt_token_ids' is not a list of token ids")
    if sent_ids is not None and tuple(prompt_ids) != tuple(sent_ids):
        raise ValueError(
            f"its 'prompt_token_ids' ({_ids_preview(prompt_ids)}) are not the token ids sent "
            f"({_ids_preview(sent_ids)}): its prompt logprobs would be those of other tokens"
        )
    return prompt_ids


def _logprobs(values: List[Any], what: str) -> Tuple[float, ...]:
    """Convert JSON numbers to floats (a null, vLLM's -inf, to NaN), refusing the answer for a value that is no number,
    one too large for a float (``10**400``, ``1e400``) or one above 0 beyond float rounding (a log-probability never
    is)."""
    kinds = set(map(type, values))  # type sets are checked with C loops: this runs for every choice of every answer
    if not kinds <= _LOGPROB_TYPES:
        raise ValueError(f"{what} holds a value that is not a number")
    if _NONE_TYPE in kinds:
        values = [math.nan if value is None else value for value in values]
    try:
        floats = tuple(map(float, values))
    except OverflowError:  # an integer such as 10**400
        raise ValueError(f"{what} holds a number too large for a float") from None
    if _INFINITY in map(abs, floats):  # a literal such as 1e400: strict JSON writers refuse it
        raise ValueError(f"{what} holds a number too large for a float")
    if max(filter(math.isfinite, floats), default=0.0) > MAX_LOGPROB:  # NaN (a null) compares false: left out
        position, value = next((i, v) for i, v in enumerate(floats) if v > MAX_LOGPROB)
        raise ValueError(f"{what} holds {value!r} at position {position}: a logprob is never above 0")
    return floats


def sequence_fields(choice: Dict[str, Any], topk: int = 0) -> Dict[str, Any]:
    """Read one choice into the fields of a ``GeneratedSequence``; it must carry its token ids and one logprob per
    token (the client always asks for both).

    With ``topk``, it must also carry the top-k alternatives of each position, keyed ``"token_id:<id>"``.
    """
    index = choice.get("index", 0)
    tokens = choice.get("token_ids")
    # Type sets are checked with C loops: this runs for every choice of every answer.
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= _INT_TYPE:
        raise ValueError(f"choice {index} has no 'token_ids' list of ints (vLLM sends them for return_token_ids)")
    block = choice.get("logprobs")
    block = block if isinstance(block, dict) else {}
    token_logprobs, text = _logprobs_and_text(choice, block, len(tokens), index)
    return dict(
        tokens=tuple(tokens),
        logprobs=_logprobs(token_logprobs, f"choice {index}'s logprobs"),
        stop_reason=str(choice.get("finish_reason") or ""),
        text=str(text or ""),
        matched_stop=choice.get("stop_reason"),
        topk_logprobs=_sampled_topk(block, len(tokens), topk, index) if topk else None,
    )


def _logprobs_and_text(
    choice: Dict[str, Any], block: Dict[str, Any], length: int, index: object
) -> Tuple[List[Any], Any]:
    """Return a choice's ``length`` token logprobs (unchecked JSON values) and its text.

    A chat choice holds one ``{"token", "logprob", ...}`` per token in ``logprobs.content`` and its text in
    ``message.content``; a completion choice its logprobs in ``logprobs.token_logprobs`` and its text in ``text``.
    """
    message = choice.get("message")
    if isinstance(message, dict):
        entries = block.get("content")
        usable = isinstance(entries, list) and set(map(type, entries)) <= _DICT_TYPE
        token_logprobs = [entry.get("logprob") for entry in cast(List[Dict[str, Any]], entries)] if usable else None
        text, where = message.get("content"), "logprobs.content"
    else:
        token_logprobs, text, where = block.get("token_logprobs"), choice.get("text"), "logprobs.token_logprobs"
    if not isinstance(token_logprobs, list) or len(token_logprobs) != length:
        raise ValueError(f"choice {index} has no '{where}' list with one entry per token")
    return token_logprobs, text


#: The key prefix of a token in vLLM's logprobs with ``return_tokens_as_token_ids``.
_TOKEN_ID_PREFIX = "token_id:"  # noqa: S105  (a key prefix, not a secret)


def _sampled_topk(block: Dict[str, Any], length: int, k: int, index: object) -> Tuple[TopKPairs, ...]:
    """Read the top-k alternatives of each generated position (``logprobs.top_logprobs``), best first, trimmed to k."""
    tops = block.get("top_logprobs")
    if not isinstance(tops, list) or len(tops) != length:
        raise ValueError(f"choice {index} has no 'logprobs.top_logprobs' list with one entry per token")
    return tuple(_token_id_pairs(top, k, f"choice {index}", position) for position, top in enumerate(tops))


def _token_id_pairs(top: Any, k: int, where: str, position: int) -> TopKPairs:
    """Read one position's ``{"token_id:<id>": logprob}`` alternatives as ``(token_id, logprob)``, best k first."""
    pairs: List[Tuple[int, float]] = []
    for key, value in top.items() if isinstance(top, dict) else ():
        digits = key[len(_TOKEN_ID_PREFIX) :] if isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX) else ""
        if not digits.isdigit() or not isinstance(value, _NUMBER_TYPES) or isinstance(value, bool):
            raise ValueError(
                f"{where} has a top logprob at position {position} that is not a "
                f"'{_TOKEN_ID_PREFIX}<id>': number pair ({key!r}); is return_tokens_as_token_ids honoured?"
            )
        pairs.append((int(digits), float(value)))
    pairs.sort(key=lambda pair: -pair[1])
    return tuple(pairs[:k])


def _actual_logprobs(
    raw: List[Optional[Dict[str, Any]]], prompt_ids: Optional[Sequence[int]]
) -> Tuple[Optional[float], ...]:
    """Read each prompt token's own logprob from vLLM's prompt_logprobs (``[None, {"<id>": {"logprob", ...}}, ...]``).

    Every position after the first must hold the prompt token's own entry (vLLM always adds it to the top k), so a
    missing one is an error rather than a silent ``None``; without the prompt's token ids, every entry is None.
    """
    if prompt_ids is None:
        return (None,) * len(raw)
    actual: List[Optional[float]] = [None]
    for position, (entry, key) in enumerate(zip(raw[1:], map(str, prompt_ids[1:])), 1):
        chosen = entry.get(key) if entry else None
        logprob = chosen.get("logprob") if isinstance(chosen, dict) else None
        if not isinstance(logprob, _NUMBER_TYPES) or isinstance(logprob, bool):
            raise ValueError(f"its prompt logprobs at position {position} lack prompt token {key}'s own entry")
        actual.append(logprob)
    return (None, *_logprobs(actual[1:], "its prompt logprobs"))


def _ids_preview(ids: Sequence[int]) -> str:
    """A short view of a token id list for a message: its length and first ids."""
    head = ", ".join(map(str, ids[:6]))
    return f"{len(ids)} ids: [{head}{', ...' if len(ids) > 6 else ''}]"


def _rank_of(item: Tuple[str, Dict[str, Any]]) -> Tuple[int, float]:
    info = item[1]
    return info.get("rank") or 1 << 30, -info["logprob"]


def ranked(entry: Optional[Dict[str, Dict[str, Any]]], k: int) -> Optional[TopKPairs]:
    """Return the best ``k`` ``(token_id, logprob)`` pairs of one position, by rank (vLLM adds the prompt token)."""
    if not entry:
        return None
    pairs = sorted(entry.items(), key=_rank_of)[:k]
    return tuple([(int(token), float(info["logprob"])) for token, info in pairs])
