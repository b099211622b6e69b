"""Tokenization and generation for FakeEngine: the byte tokenizer, completion-parameter parsing and the sampler.

Owns token ids, stop handling and logprobs; it does no HTTP, keeps no engine state and never touches adapters.
Stdlib only.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass
from typing import Any

from lora_sampler.testing import _bodies as bodies

#: Ids 0-3 are the tiny tokenizer's specials (FINDINGS §2); byte ``b`` of UTF-8 text is id ``4 + b``.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
#: vLLM's default ``--max-logprobs`` (the limit message is vLLM's wording, not in FINDINGS).
MAX_LOGPROBS = 20


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(payload: dict[str, Any]) -> CompletionRequest | str:
    """Return the completion parameters the fake honours, or a 400 message."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        prompt = encode_text(prompt)
    elif not (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        return "prompt must be a string or a list of token ids (the fake engine takes one prompt)"
    if not prompt:
        return "Either prompt or prompt_embeds must be provided and non-empty."
    stop = payload.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = payload.get("stop_token_ids") or []
    max_tokens = 16 if payload.get("max_tokens") is None else payload["max_tokens"]
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
    return CompletionRequest(
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
    )


class Sampler:
    """Pseudo-random generation, deterministic in (seed, model, prompt, choice index) when seeded or greedy."""

    def __init__(self, model: str, request: CompletionRequest, max_tokens: int, vocab_size: int) -> None:
        self.request, self.max_tokens, self.vocab_size = request, max_tokens, vocab_size
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
            self._prompt_logprobs = self._make_prompt_logprobs(model, request.prompt_logprobs)

    def choice(self, index: int) -> dict[str, Any]:
        """Generate choice ``index``: stop on a stop token id or stop string, else run to ``max_tokens``."""
        material = self._material if self._greedy else f"{self._material}|{index}"
        rng = random.Random(material)
        ids: list[int] = []
        text, finish = "", "length"
        reason: int | str | None = None
        for _ in range(self.max_tokens):
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
        logprobs = None if self.request.logprobs is None else self._logprobs(material, ids, self.request.logprobs)
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
        for step, token in enumerate(ids):
            rng = random.Random(f"{material}|lp|{step}")  # per step, so k does not change other values
            value = -rng.uniform(0.01, 1.0)
            top = {decode_token(token): value}
            alternative = value
            while len(top) < k:
                key = decode_token(rng.randrange(BYTE_OFFSET, self.vocab_size))
                if key not in top:
                    alternative -= rng.uniform(0.05, 1.0)
                    top[key] = alternative
            offsets.append(offset)
            offset += len(decode_token(token))
            tokens.append(decode_token(token))
            values.append(value)
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def _make_prompt_logprobs(self, model: str, k: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None first, then the prompt token's own entry and the top k (k or k+1 entries)."""
        return prompt_logprobs(model, self.request.prompt, k, self.vocab_size)


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
    prefix = hashlib.blake2b(model.encode("utf-8"), digest_size=16)
    for position in range(1, len(prompt)):
        prefix.update(b"%d," % prompt[position - 1])
        rng = random.Random(prefix.digest())
        values = sorted((-rng.uniform(0.01, 8.0) for _ in range(_RANKED)), reverse=True)
        ranked: list[int] = []
        while len(ranked) < _RANKED:
            candidate = rng.randrange(BYTE_OFFSET, vocab_size)
            if candidate not in ranked:
                ranked.append(candidate)
        token = prompt[position]
        if token in ranked:
            rank, value = ranked.index(token) + 1, values[ranked.index(token)]
        else:  # below the ranked ones: its own value, from the prefix and the token
            below = random.Random(prefix.digest() + b"%d" % token)
            rank, value = _RANKED + 1 + below.randrange(vocab_size), values[-1] - below.uniform(0.01, 4.0)
        entry = {str(token): _entry(value, rank, token)}
        for place, other in enumerate(ranked[:k], 1):
            entry.setdefault(str(other), _entry(values[place - 1], place, other))
        out.append(entry)
    return out


def _entry(value: float, rank: int, token: int) -> dict[str, Any]:
    return {"logprob": value, "rank": rank, "decoded_token": decode_token(token)}
