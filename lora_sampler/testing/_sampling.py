"""Tokenization and generation for FakeEngine: the byte tokenizer, completion-parameter parsing and the sampler.

Owns token ids, stop handling and logprobs; it does no HTTP, keeps no engine state and never touches adapters.
Stdlib only.
"""

from __future__ import annotations

import collections
import hashlib
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from lora_sampler.testing import _bodies as bodies

#: Ids 0-3 are the tiny tokenizer's specials; byte ``b`` of UTF-8 text is id ``4 + b``.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
#: vLLM's default ``--max-logprobs`` (the limit message is vLLM's wording, not read off an engine).
MAX_LOGPROBS = 20
#: Tokens per block of the fake's prefix cache (``FakeEngine(prompt_tokens_details=True)``).
PREFIX_BLOCK = 16
#: Block-aligned prefixes the fake's prefix cache remembers (the oldest are forgotten first).
PREFIX_CACHE_ENTRIES = 4096


def encode_text(text: str) -> list[int]:
    """Tokenize ``text`` the fake's way: each UTF-8 byte ``b`` becomes token id ``4 + b`` (no BOS)."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def decode_token(token_id: int) -> str:
    """Return the text of one token: a special, a printable byte, ``<0xHH>``, or `` t<id>`` above the bytes."""
    if token_id < BYTE_OFFSET:
        return SPECIAL_TOKENS[token_id]
    byte = token_id - BYTE_OFFSET
    if byte < 256:
        return chr(byte) if 32 <= byte < 127 else f"<0x{byte:02X}>"
    return f" t{token_id}"


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
    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    logprobs: int | None
    prompt_logprobs: int | None
    return_token_ids: bool
    #: vLLM's ``return_tokens_as_token_ids``: logprob tokens read ``token_id:<id>`` instead of their text.
    tokens_as_ids: bool = False


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


def parse_request(payload: dict[str, Any]) -> list[CompletionRequest] | str:
    """Return the completion parameters the fake honours, one request per prompt, or a 400 message."""
    prompts = parse_prompts(payload.get("prompt"))
    if isinstance(prompts, str):
        return prompts
    stop = payload.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = payload.get("stop_token_ids") or []
    max_tokens = 16 if payload.get("max_tokens") is None else payload["max_tokens"]  # vLLM 0.32: null is 16 too
    n, seed, temperature = payload.get("n", 1), payload.get("seed"), payload.get("temperature")
    logprobs, prompt_logprobs = payload.get("logprobs"), payload.get("prompt_logprobs")
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "stop must be a string or a list of strings"
    if not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        return "stop_token_ids must be a list of integers"
    if not (_is_int(n) and n >= 1) or not (_is_int(max_tokens) and max_tokens >= 0):
        return "n must be at least 1 and max_tokens at least 0"
    if not (seed is None or _is_int(seed)) or not (temperature is None or isinstance(temperature, (int, float))):
        return "seed must be an integer and temperature a number"
    for kind, value in (("sample", logprobs), ("prompt", prompt_logprobs)):
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            return f"Requested {kind} logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}"
    return [
        CompletionRequest(
            prompt=prompt,
            n=n,
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=frozenset(stop_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            return_token_ids=bool(payload.get("return_token_ids")),
            tokens_as_ids=bool(payload.get("return_tokens_as_token_ids")),
        )
        for prompt in prompts
    ]


class Sampler:
    """Pseudo-random generation, deterministic in (seed, model, prompt, choice index) when seeded or greedy.

    Greedy generation follows the same model as ``prompt_logprobs``: each step takes the model's most likely token
    and reports its logprob, so a token's generation logprob equals its prompt logprob after the same prefix, as on
    a healthy engine. ``prompt_model`` computes the prompt logprobs under another model (the engine defects).
    """

    def __init__(
        self, model: str, request: CompletionRequest, max_tokens: int, vocab_size: int, prompt_model: str | None = None
    ) -> None:
        self.request, self.max_tokens, self.vocab_size = request, max_tokens, vocab_size
        self.model = model
        prompt_key = f"{model}|{','.join(map(str, request.prompt))}"
        self._greedy = request.temperature == 0  # greedy ignores the seed and gives n identical choices
        if self._greedy:
            self._material = f"greedy|{prompt_key}"
        elif request.seed is not None:
            self._material = f"{request.seed}|{prompt_key}"
        else:
            self._material = uuid.uuid4().hex
        self.token_ids: dict[int, list[int]] = {}
        self._prompt_logprobs: list[dict[str, Any] | None] | None = None
        if request.prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs(
                prompt_model or model, request.prompt, request.prompt_logprobs, vocab_size
            )

    def choice(self, index: int) -> dict[str, Any]:
        """Generate choice ``index``: stop on a stop token id or stop string, else run to ``max_tokens``."""
        material = self._material if self._greedy else f"{self._material}|{index}"
        rng = random.Random(material)
        ids: list[int] = []
        text, finish = "", "length"
        reason: int | str | None = None
        model = _ModelSteps(self.model, self.request.prompt, self.vocab_size) if self._greedy else None
        greedy: list[tuple[float, list[tuple[int, float]]]] = []
        for _ in range(self.max_tokens):
            if model is not None:
                step = model.next_step()
                token = step[1][0][0]
                greedy.append(step)
                model.advance(token)
            else:
                token = rng.randrange(BYTE_OFFSET, self.vocab_size)  # never a special, so never EOS
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
        logprobs = None
        if self.request.logprobs is not None:
            k = self.request.logprobs
            logprobs = self._greedy_logprobs(ids, greedy, k) if greedy else self._logprobs(material, ids, k)
        with_ids = self.request.return_token_ids
        return bodies.completion_choice(
            index,
            text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=reason,
            token_ids=list(ids) if with_ids else None,
            prompt_logprobs=self._prompt_logprobs,
            prompt_token_ids=list(self.request.prompt) if with_ids else None,
        )

    def _logprobs(self, material: str, ids: list[int], k: int) -> dict[str, Any]:
        """vLLM's completion logprobs; the sampled token is always rank 1, so each dict has max(k, 1) entries."""
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offset = 0
        name = _token_id_name if self.request.tokens_as_ids else decode_token
        for step, token in enumerate(ids):
            rng = random.Random(f"{material}|lp|{step}")  # per step, so k does not change other values
            value = -rng.uniform(0.01, 1.0)
            top = {name(token): value}
            alternative = value
            while len(top) < k:
                key = name(rng.randrange(BYTE_OFFSET, self.vocab_size))
                if key not in top:
                    alternative -= rng.uniform(0.05, 1.0)
                    top[key] = alternative
            offsets.append(offset)
            offset += len(decode_token(token))
            tokens.append(name(token))
            values.append(value)
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    @staticmethod
    def _greedy_logprobs(ids: list[int], steps: list[tuple[float, list[tuple[int, float]]]], k: int) -> dict[str, Any]:
        """vLLM's completion logprobs of a greedy generation: the model's own values, best first."""
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        offset = 0
        for token, (value, ranked) in zip(ids, steps):
            top = {decode_token(token): value}
            for other, other_value in ranked[: max(k, 1)]:
                if len(top) >= max(k, 1):
                    break
                top.setdefault(decode_token(other), other_value)
            offsets.append(offset)
            offset += len(decode_token(token))
            tops.append(top)
        values = [value for value, _ in steps[: len(ids)]]
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": [decode_token(token) for token in ids],
            "top_logprobs": tops,
        }


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
