"""Generation for FakeEngine: the one parse and check of a completion request, the sampler, the fake's model of
prompt logprobs, and its prefix cache.

Owns stop handling and logprobs (the vocabulary is ``_tokenizer``'s); it does no HTTP, keeps no engine state and
never touches adapters. Stdlib only.
"""

from __future__ import annotations

import collections
import hashlib
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any, List, Tuple

from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing._bodies import VllmBody
from lora_sampler.testing._tokenizer import BYTE_OFFSET, decode_token, encode_text

#: vLLM's default ``--max-logprobs`` (the limit message is vLLM's wording, not read off an engine).
MAX_LOGPROBS = 20
#: Tokens per block of the fake's prefix cache (``FakeEngine(prompt_tokens_details=True)``).
PREFIX_BLOCK = 16
#: Block-aligned prefixes the fake's prefix cache remembers (the oldest are forgotten first).
PREFIX_CACHE_ENTRIES = 4096


class PrefixCache:
    """The fake's prefix cache: which block-aligned prompt prefixes each model has computed (bounded, LRU).

    ``served`` answers how many of a prompt's tokens a real engine would take from its cache: the longest prefix in
    whole ``PREFIX_BLOCK`` blocks seen before for that model, short of the whole prompt (the last token is always
    computed), then remembers the prompt's own block prefixes.
    """

    def __init__(self, entries: int = PREFIX_CACHE_ENTRIES) -> None:
        self._entries = entries
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def served(self, model: str, prompt: list[int]) -> int:
        keys = [
            hashlib.blake2b(f"{model}|{prompt[:end]}".encode(), digest_size=16).hexdigest()
            for end in range(PREFIX_BLOCK, len(prompt) + 1, PREFIX_BLOCK)
        ]
        with self._lock:
            cached = 0
            for blocks, key in enumerate(keys, 1):
                if key not in self._seen or blocks * PREFIX_BLOCK >= len(prompt):
                    break
                cached = blocks * PREFIX_BLOCK
            for key in keys:
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > self._entries:
                self._seen.popitem(last=False)
        return cached


@dataclass(frozen=True)
class CompletionRequest:
    """A ``/v1/completions`` request as the fake honours it, checked: its prompts as token ids, each prompt's
    ``max_tokens`` clamped to the context (``limits``), and the sampling parameters the prompts share."""

    prompts: list[list[int]]
    limits: list[int]
    #: The prompts as sent when they were texts, else None (what a text marker of a prompt fault is looked for in).
    texts: list[str] | None
    n: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    logprobs: int | None
    prompt_logprobs: int | None
    return_token_ids: bool
    #: vLLM's ``return_tokens_as_token_ids``: logprob tokens read ``token_id:<id>`` instead of their text.
    tokens_as_ids: bool = False
    #: The 400 of vLLM's checks against the context and vocabulary, or None: the request is answered.
    refusal: VllmBody | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompts(value: Any) -> list[list[int]] | str:
    """Return the prompts of a completion body as token ids, or a 400 message (vLLM's wording where known).

    As vLLM's ``/v1/completions`` takes them: one text, one list of token ids, or a list of either (not mixed);
    the answer then holds ``n`` choices per prompt, indexed prompt by prompt.
    """
    if isinstance(value, str):
        return [encode_text(value)] if value else "Either prompt or prompt_embeds must be provided and non-empty."
    if not isinstance(value, list):
        return "prompt must be a string, a list of token ids, or a list of either"
    if all(_is_int(t) for t in value):
        return [value] if value else "You must pass at least one prompt"
    if all(isinstance(item, str) for item in value):
        prompts = [encode_text(item) for item in value]
    elif all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value):
        prompts = [list(item) for item in value]
    else:
        return "prompt must be a string, a list of token ids, or a list of either (all texts or all token id lists)"
    if not all(prompts):
        return "The decoder prompt cannot be empty"
    return prompts


def _parameters(payload: dict[str, Any]) -> dict[str, Any] | str:
    """The sampling fields of a completion body's ``CompletionRequest`` and its ``max_tokens``, with vLLM's defaults,
    or the 400 message of the first bad one."""
    stop, temperature = payload.get("stop") or [], payload.get("temperature")
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids, n, seed = payload.get("stop_token_ids") or [], payload.get("n", 1), payload.get("seed")
    max_tokens = 16 if payload.get("max_tokens") is None else payload["max_tokens"]  # vLLM 0.32: null is 16 too
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "stop must be a string or a list of strings"
    if not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        return "stop_token_ids must be a list of integers"
    if not (_is_int(n) and n >= 1) or not (_is_int(max_tokens) and max_tokens >= 0):
        return "n must be at least 1 and max_tokens at least 0"
    if not (seed is None or _is_int(seed)) or not (temperature is None or isinstance(temperature, (int, float))):
        return "seed must be an integer and temperature a number"
    for kind, field in (("sample", "logprobs"), ("prompt", "prompt_logprobs")):
        value = payload.get(field)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            return f"Requested {kind} logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}"
    return {
        "stop": tuple(stop),
        "stop_token_ids": frozenset(stop_ids),
        "n": n,
        "seed": seed,
        "max_tokens": max_tokens,
        "temperature": 1.0 if temperature is None else float(temperature),
        "logprobs": payload.get("logprobs"),
        "prompt_logprobs": payload.get("prompt_logprobs"),
        "return_token_ids": bool(payload.get("return_token_ids")),
        "tokens_as_ids": bool(payload.get("return_tokens_as_token_ids")),
    }


def parse_request(payload: dict[str, Any], max_model_len: int, vocab_size: int) -> CompletionRequest | VllmBody:
    """vLLM's checks of a completion body, in its order: the 400 refusing its prompts or parameters, else the request
    the fake honours (whose ``refusal`` is the 400 of vLLM's length and vocabulary checks, if any)."""
    prompts = parse_prompts(payload.get("prompt"))
    if isinstance(prompts, str):
        return bodies.bad_request(prompts)
    fields = _parameters(payload)
    if isinstance(fields, str):
        return bodies.bad_request(fields)
    max_tokens = fields.pop("max_tokens")  # not the request's own: each prompt's limit is clamped from it
    text = payload["prompt"]
    return CompletionRequest(
        prompts=prompts,
        limits=[min(max_tokens, max_model_len - len(prompt)) for prompt in prompts],
        texts=[text] if isinstance(text, str) else text if isinstance(text[0], str) else None,
        refusal=_refusal(prompts, fields["n"], max_tokens, fields["temperature"], max_model_len, vocab_size),
        **fields,
    )


def _refusal(
    prompts: list[list[int]], n: int, max_tokens: int, temperature: float, max_model_len: int, vocab_size: int
) -> VllmBody | None:
    """vLLM's checks of a parsed request's sampling against its context and vocabulary, in its order."""
    if temperature < 1e-5 and n > 1:  # vLLM's _SAMPLING_EPS: greedy gives one sample
        return bodies.greedy_needs_one_sample(n)
    if max_tokens > max_model_len:
        return bodies.max_tokens_too_large(max_tokens, max_model_len)
    for prompt in prompts:
        if len(prompt) > max_model_len:
            return bodies.prompt_too_long(max_model_len, len(prompt))
        if min(max_tokens, max_model_len - len(prompt)) < 1:  # clamped to the context
            return bodies.max_tokens_zero()
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            return bodies.token_out_of_vocab(outside[0])
    return None


#: A generation step's logprob and the ranked ``(token, logprob)`` alternatives reported beside it.
Step = Tuple[float, List[Tuple[int, float]]]


class Sampler:
    """Pseudo-random generation of one prompt, deterministic in (seed, model, prompt, choice index) when seeded or
    greedy.

    Greedy generation follows the same model as ``prompt_logprobs``: each step takes the model's most likely token
    and reports its logprob, so a token's generation logprob equals its prompt logprob after the same prefix, as on
    a healthy engine. ``prompt_model`` computes the prompt logprobs under another model (the engine defects).
    """

    def __init__(
        self, model: str, request: CompletionRequest, position: int, vocab_size: int, prompt_model: str | None = None
    ) -> None:
        self.request, self.vocab_size, self.model = request, vocab_size, model
        self.prompt, self.max_tokens = request.prompts[position], request.limits[position]
        prompt_key = f"{model}|{','.join(map(str, self.prompt))}"
        self._greedy = request.temperature == 0  # greedy ignores the seed and gives n identical choices
        if self._greedy:
            self._material = f"greedy|{prompt_key}"
        elif request.seed is not None:
            self._material = f"{request.seed}|{prompt_key}"
        else:
            self._material = uuid.uuid4().hex
        #: The token ids generated for each choice index.
        self.token_ids: dict[int, list[int]] = {}
        self._prompt_logprobs: list[dict[str, Any] | None] | None = None
        if request.prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs(
                prompt_model or model, self.prompt, request.prompt_logprobs, vocab_size
            )

    def choice(self, index: int) -> dict[str, Any]:
        """Generate choice ``index``: stop on a stop token id or stop string, else run to ``max_tokens``."""
        material = self._material if self._greedy else f"{self._material}|{index}"
        rng = random.Random(material)
        ids: list[int] = []
        text, finish = "", "length"
        reason: int | str | None = None
        model = _ModelSteps(self.model, self.prompt, self.vocab_size) if self._greedy else None
        steps: list[Step] = []
        k = self.request.logprobs or 0
        for step in range(self.max_tokens):
            if model is not None:
                steps.append(model.next_step())
                token = steps[-1][1][0][0]
                model.advance(token)
            else:
                token = rng.randrange(BYTE_OFFSET, self.vocab_size)  # never a special, so never EOS
                if self.request.logprobs is not None:
                    steps.append(self._random_step(f"{material}|lp|{step}", token, k))
            ids.append(token)
            if token in self.request.stop_token_ids:
                finish, reason = "stop", token  # kept in token_ids, not detokenized
                break
            text += decode_token(token)
            hits = [(text.find(stop), stop) for stop in self.request.stop if stop and stop in text]
            if hits:
                cut, stop = min(hits)
                text, finish, reason = text[:cut], "stop", stop
                break
        self.token_ids[index] = ids
        with_ids = self.request.return_token_ids
        return bodies.completion_choice(
            index,
            text,
            logprobs=None if self.request.logprobs is None else self._logprobs(ids, steps, k),
            finish_reason=finish,
            stop_reason=reason,
            token_ids=list(ids) if with_ids else None,
            prompt_logprobs=self._prompt_logprobs,
            prompt_token_ids=list(self.prompt) if with_ids else None,
        )

    def _random_step(self, material: str, token: int, k: int) -> Step:
        """A sampled token's logprob and ``k - 1`` other tokens below it, drawn per step (so ``k`` changes no value)."""
        rng = random.Random(material)
        value = -rng.uniform(0.01, 1.0)
        ranked, alternative = [(token, value)], value
        while len(ranked) < k:
            other = rng.randrange(BYTE_OFFSET, self.vocab_size)
            if all(other != seen for seen, _ in ranked):
                alternative -= rng.uniform(0.05, 1.0)
                ranked.append((other, alternative))
        return value, ranked

    def _logprobs(self, ids: list[int], steps: list[Step], k: int) -> dict[str, Any]:
        """vLLM's completion logprobs; the generated token is always in its top, so each has max(k, 1) entries."""
        name = _token_id_name if self.request.tokens_as_ids else decode_token
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        offset = 0
        for token, (value, ranked) in zip(ids, steps):
            top = {name(token): value}
            for other, other_value in ranked:
                if len(top) >= max(k, 1):
                    break
                top.setdefault(name(other), other_value)
            offsets.append(offset)
            offset += len(decode_token(token))
            tops.append(top)
        values = [value for value, _ in steps[: len(ids)]]
        tokens = [name(token) for token in ids]
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def _token_id_name(token_id: int) -> str:
    """A token as vLLM names it in logprobs under ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}"


#: The fake's "model" ranks this many tokens at each position; the rest score below them.
_RANKED = MAX_LOGPROBS


def prompt_logprobs(model: str, prompt: list[int], k: int, vocab_size: int) -> list[dict[str, Any] | None]:
    """Return vLLM's ``prompt_logprobs`` for ``prompt`` under ``model``: None first, then one entry per token.

    Each entry is keyed by token id strings, the prompt token first (with its rank), then the top ``k`` by rank, as
    vLLM sends them. Like a real model's, a token's logprob depends only on the model, the tokens before it and the
    token itself, never on ``k``: scoring a completion after a prompt gives the same logprobs as scoring the whole,
    and each model name (an adapter's included) gives its own, deterministically.
    """
    out: list[dict[str, Any] | None] = [None]
    steps = _ModelSteps(model, prompt[:1], vocab_size)
    for position in range(1, len(prompt)):
        values, ranked = steps.distribution()
        token = prompt[position]
        value, rank = steps.logprob_of(token, values, ranked)
        entry = {str(token): _entry(value, rank, token)}
        for place, other in enumerate(ranked[:k], 1):
            entry.setdefault(str(other), _entry(values[place - 1], place, other))
        out.append(entry)
        steps.advance(token)
    return out


class _ModelSteps:
    """The fake's model: the distribution of the next token given a model name and the tokens so far."""

    def __init__(self, model: str, tokens: list[int], vocab_size: int) -> None:
        self._prefix = hashlib.blake2b(model.encode("utf-8"), digest_size=16)
        self._vocab_size = vocab_size
        for token in tokens:
            self.advance(token)

    def advance(self, token: int) -> None:
        """Append one token to the prefix."""
        self._prefix.update(b"%d," % token)

    def distribution(self) -> tuple[list[float], list[int]]:
        """The ranked tokens after the prefix and their logprobs, best first."""
        rng = random.Random(self._prefix.digest())
        values = sorted((-rng.uniform(0.01, 8.0) for _ in range(_RANKED)), reverse=True)
        ranked: list[int] = []
        while len(ranked) < _RANKED:
            candidate = rng.randrange(BYTE_OFFSET, self._vocab_size)
            if candidate not in ranked:
                ranked.append(candidate)
        return values, ranked

    def logprob_of(self, token: int, values: list[float], ranked: list[int]) -> tuple[float, int]:
        """The logprob and rank of ``token`` after the prefix."""
        if token in ranked:
            return values[ranked.index(token)], ranked.index(token) + 1
        below = random.Random(self._prefix.digest() + b"%d" % token)  # below the ranked ones: its own value
        return values[-1] - below.uniform(0.01, 4.0), _RANKED + 1 + below.randrange(self._vocab_size)

    def next_step(self) -> tuple[float, list[tuple[int, float]]]:
        """The greedy step: the best token's logprob, and the ranked ``(token, logprob)`` pairs."""
        values, ranked = self.distribution()
        return values[0], list(zip(ranked, values))


def _entry(value: float, rank: int, token: int) -> dict[str, Any]:
    return {"logprob": value, "rank": rank, "decoded_token": decode_token(token)}
