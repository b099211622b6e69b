"""Scoring: the logprob of given tokens under an adapter or the base model (see docs/guides/scoring.md).

Owns turning a ``ScoreRequest`` into engine requests: texts that must be split at the prompt/completion boundary are
tokenized by the engine (``POST /tokenize``, under the retry policy), then one completion asks for the prompt
tokens' own logprobs (vLLM's ``prompt_logprobs=0``) and a single generated token, through the client's sampling path
(so the adapter race, the retry contract and the exact-answer checks all apply).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from lora_sampler._transport.http import EngineTransport, new_id
from lora_sampler._wire.routes import TOKENIZE_PATH
from lora_sampler.errors import EngineError, EngineProtocolError
from lora_sampler.retry import RetryPolicy, make_retrying
from lora_sampler.types import Prompt, SampleOutput, SampleRequest, SamplingParams, ScoreOutput, ScoreRequest

#: vLLM computes prompt logprobs only alongside generation: one token is the least it generates. The logprobs are
#: the model's own (vLLM's default ``logprobs_mode`` is raw), so temperature does not change them.
SCORING_PARAMS = SamplingParams(max_tokens=1)


@dataclass
class _TokenizeCall:
    """One ``POST /tokenize`` as the retry glue sees it."""

    model: str
    text: str
    special_tokens: bool
    session_id: str
    is_adapter: bool = False
    started: float = field(default_factory=time.monotonic)


class Scorer:
    """Runs ``ScoreRequest`` values for one client.

    It holds no reference to the client (only to its parts), so a client dropped without ``close()`` is still freed
    by reference counting.

    Args:
        transport: The client's transport (for ``/tokenize``).
        policy: The client's retry policy (a tokenize request is a base-model request in the retry table).
        run: Sends one ``SampleRequest`` through the retry contract (the client's sampling path).
        base_models: Returns the names the engine serves its base model under (the tokenizer's model).
    """

    def __init__(
        self,
        transport: EngineTransport,
        policy: RetryPolicy,
        run: Callable[[SampleRequest], SampleOutput],
        base_models: Callable[[], Tuple[str, ...]],
    ):
        self._base_url, self._run, self._base_models = transport.base_url, run, base_models
        self._tokenize = make_retrying(policy, _Tokenizer(transport).attempt, _nothing_to_prepare)

    def run_any(self, request: Union[SampleRequest, ScoreRequest]) -> Any:
        """Run one request of a fan-out: score a ``ScoreRequest``, sample anything else."""
        return self.score(request) if isinstance(request, ScoreRequest) else self._run(request)

    def score(self, request: ScoreRequest) -> ScoreOutput:
        """Score one request: tokenize what must be split, then one completion with the prompt tokens' logprobs.

        Raises:
            ValueError: the prompt holds no token once tokenized (nothing to condition on).
            EngineError: the engine's answer after the retry table ran its course.
        """
        session = request.session_id or new_id()
        if request.completion is None:
            sequence, start = request.prompt, 1
        else:
            model = request.base_model or self._base_models()[0]
            prompt = self._tokens(request.prompt, model, True, session)
            if not prompt:
                raise ValueError("the prompt holds no token once tokenized; a completion is scored given a prompt")
            completion = self._tokens(request.completion, model, False, session)
            if not completion:
                raise ValueError(
                    f"the completion {request.completion!r} holds no token once tokenized by the engine, so there is "
                    "nothing to score; give it text the tokenizer keeps, or token ids"
                )
            sequence = prompt + completion
            start = len(prompt)
        sample = SampleRequest(
            sequence,
            adapter=request.adapter,
            base_model=request.base_model,
            sampling_params=SCORING_PARAMS,
            prompt_logprobs=True,
            session_id=session,
        )
        output = self._run(sample)
        tokens = _prompt_tokens(output, sequence)
        if output.prompt_logprobs is None or tokens is None:  # from_json checked the logprobs of known tokens
            raise EngineProtocolError(
                f"the engine at {self._base_url} answered a text prompt without its prompt_token_ids, so its "
                "logprobs cannot be matched to tokens; score token ids instead, or use a vLLM that sends them",
                model=output.model,
                adapter=request.adapter is not None,
            )
        return ScoreOutput(tokens, output.prompt_logprobs, start, output.model)

    def _tokens(self, part: Prompt, model: str, special_tokens: bool, session: str) -> Tuple[int, ...]:
        if not isinstance(part, str):
            return tuple(part)
        return self._tokenize(_TokenizeCall(model, part, special_tokens, session))


class _Tokenizer:
    """The one attempt of a tokenize call (kept apart from ``Scorer``, so its retry wrapper makes no cycle)."""

    def __init__(self, transport: EngineTransport):
        self._transport = transport

    def attempt(self, call: _TokenizeCall) -> Tuple[int, ...]:
        """Send exactly one ``POST /tokenize``."""
        payload = {"model": call.model, "prompt": call.text, "add_special_tokens": call.special_tokens}
        return self._transport.post_json(
            TOKENIZE_PATH, payload, model=call.model, session_id=call.session_id, parse=_tokens_of
        )


def _nothing_to_prepare(call: _TokenizeCall, error: EngineError, attempt: int) -> None:
    """A tokenize request names the base model: no adapter to load before its retry."""


def _tokens_of(body: Any) -> Tuple[int, ...]:
    """Read vLLM's ``/tokenize`` answer ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
        raise ValueError("it has no 'tokens' list of ints; is base_url a vLLM server?")
    return tuple(tokens)


def _prompt_tokens(output: SampleOutput, sent: Prompt) -> Optional[Tuple[int, ...]]:
    """Return the prompt's token ids: those sent, or for text those the engine reports (``prompt_token_ids``)."""
    if not isinstance(sent, str):
        return tuple(sent)
    choices: Optional[Sequence[Any]] = (output.body or {}).get("choices")
    ids = choices[0].get("prompt_token_ids") if choices else None
    return tuple(ids) if isinstance(ids, list) and set(map(type, ids)) <= {int} else None
