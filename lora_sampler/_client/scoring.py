"""Scoring: the logprob of given tokens under an adapter or the base model (see docs/guides/scoring.md).

Owns turning a ``ScoreRequest`` into engine requests: texts that must be split at the prompt/completion boundary are
tokenized by the engine (``POST /tokenize``, under the retry policy), then one completion asks for the prompt
tokens' own logprobs (vLLM's ``prompt_logprobs=0``) and a single generated token, through the client's sampling path
(so the adapter race, the retry contract and the exact-answer checks all apply).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union, cast

from lora_sampler._client.calls import SampleCalls
from lora_sampler._client.outage import is_outage
from lora_sampler._transport.exchange import new_id
from lora_sampler.errors import EngineError, EngineProtocolError
from lora_sampler.types import Prompt, SampleOutput, SampleRequest, SamplingParams, ScoreOutput, ScoreRequest

#: vLLM computes prompt logprobs only alongside generation: one token is the least it generates. The logprobs are
#: the model's own (vLLM's default ``logprobs_mode`` is raw), so temperature does not change them.
SCORING_PARAMS = SamplingParams(max_tokens=1)


class Scorer:
    """Runs ``ScoreRequest`` values for one client.

    It holds no reference to the client (only to its parts), so a client dropped without ``close()`` is still freed
    by reference counting.

    Args:
        base_url: The engine root (for messages).
        calls: The client's single calls: ``run`` (one ``SampleRequest`` through the retry contract), ``run_many``
            (requests differing only in their prompt as one request) and ``tokenize`` (``/tokenize``, retried too).
        base_models: Returns the names the engine serves its base model under (the tokenizer's model).
    """

    def __init__(self, base_url: str, calls: SampleCalls, base_models: Callable[[], Tuple[str, ...]]):
        self._base_url, self._calls, self._base_models = base_url, calls, base_models

    def run_batch(self, requests: Sequence[Union[SampleRequest, ScoreRequest]]) -> List[Any]:
        """Run the requests of one fan-out batch: one alone, or several (all ``ScoreRequest`` or all ``SampleRequest``,
        sharing their settings).

        Returns:
            Per request, in order: its output, or the error for it alone.

        Raises:
            EngineError: what failed the batch as a whole (every request's error).
        """
        if isinstance(requests[0], ScoreRequest):
            return self.score_many(cast(Sequence[ScoreRequest], requests))
        return self._calls.run_many(cast(Sequence[SampleRequest], requests))

    def score(self, request: ScoreRequest) -> ScoreOutput:
        """Score one request: tokenize what must be split, then one completion with the prompt tokens' logprobs.

        Raises:
            ValueError: the prompt holds no token once tokenized (nothing to condition on).
            EngineError: the engine's answer after the retry table ran its course.
        """
        outcome = self.score_many([request])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return cast(ScoreOutput, outcome)

    def score_many(self, requests: Sequence[ScoreRequest]) -> List[Any]:
        """Score requests sharing a model and a session as one completion request with their sequences as a list.

        Texts to split are tokenized first, one ``/tokenize`` each. A request that cannot be prepared (its tokenize
        refused, or no prompt token) or answered gets its own error; the others are scored together.

        Returns:
            Per request, in order: its ``ScoreOutput``, or its error.

        Raises:
            EngineError: what failed the batch as a whole (an outage while tokenizing too).
        """
        session = requests[0].session_id or new_id()
        outcomes: List[Any] = []
        ready: List[Tuple[int, SampleRequest, int]] = []  # (position, its completion request, where scoring starts)
        for position, request in enumerate(requests):
            try:
                sample, start = self._prepare(request, session)
            except (ValueError, EngineError) as error:
                if is_outage(error):
                    raise  # the engine is away: the whole batch is held or fails, not this prompt alone
                outcomes.append(error)
                continue
            outcomes.append(None)
            ready.append((position, sample, start))
        if ready:
            answers = self._calls.run_many([sample for _, sample, _ in ready])
            for (position, sample, start), answer in zip(ready, answers):
                outcomes[position] = answer  # an error for this request alone, or its answer to read
                if not isinstance(answer, BaseException):
                    outcomes[position] = self._finish(sample, start, answer)
        return outcomes

    def _prepare(self, request: ScoreRequest, session: str) -> Tuple[SampleRequest, int]:
        """Return the completion request that scores ``request`` (its texts tokenized where they must be split), and
        the position in its prompt where scoring starts."""
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
        return sample, start

    def _finish(
        self, sample: SampleRequest, start: int, output: SampleOutput
    ) -> Union[ScoreOutput, EngineProtocolError]:
        """Read the scores of the sequence ``sample`` sent, from ``start`` on, from the engine's answer; or the error
        for this request alone when the answer cannot say which tokens they are."""
        tokens = prompt_tokens(output, sample.prompt)
        if output.prompt_logprobs is None or tokens is None:  # from_json checked the logprobs of known tokens
            return EngineProtocolError(
                f"the engine at {self._base_url} answered a text prompt without its prompt_token_ids, so its "
                "logprobs cannot be matched to tokens; score token ids instead, or use a vLLM that sends them",
                model=output.model,
                adapter=sample.adapter is not None,
            )
        return ScoreOutput(tokens, output.prompt_logprobs, start, output.model)

    def _tokens(self, part: Prompt, model: str, special_tokens: bool, session: str) -> Tuple[int, ...]:
        if not isinstance(part, str):
            return tuple(part)
        return self._calls.tokenize(part, model, add_special_tokens=special_tokens, session_id=session)


def prompt_tokens(output: SampleOutput, sent: Optional[Prompt]) -> Optional[Tuple[int, ...]]:
    """Return the prompt's token ids: those sent (a validated prompt holds them as a tuple), or for text those the
    engine reports (``prompt_token_ids``)."""
    if isinstance(sent, tuple):
        return sent
    choices: Optional[Sequence[Any]] = (output.body or {}).get("choices")
    ids = choices[0].get("prompt_token_ids") if choices else None
    return tuple(ids) if isinstance(ids, list) and set(map(type, ids)) <= {int} else None
