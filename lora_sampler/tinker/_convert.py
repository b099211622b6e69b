"""Translation between Tinker's types and lora_sampler's: prompts, sampling parameters and answers.

Tinker speaks ``tinker.ModelInput``, ``tinker.SamplingParams`` and ``tinker.SampleResponse``; the client speaks
token tuples, ``lora_sampler.SamplingParams`` and ``SampleOutput``. Each function here maps one of them, checking on
the way what vLLM's OpenAI API cannot serve, so a caller gets a ``NotImplementedError`` naming the argument rather
than an answer that silently means something else. No I/O.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import tinker
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from lora_sampler.types import SampleOutput, SamplingParams, TopK

#: The engine body field that makes vLLM generate past the end-of-sequence token (Tinker's ``stop=[]``).
IGNORE_EOS = {"ignore_eos": True}


def prompt_tokens(prompt: object) -> Tuple[int, ...]:
    """Return the token ids of a ``tinker.ModelInput`` (text chunks only: vLLM's completions take token ids).

    Raises:
        TypeError: ``prompt`` is not a ``tinker.ModelInput``.
        NotImplementedError: it holds image or audio chunks.
    """
    if not isinstance(prompt, tinker.ModelInput):
        raise TypeError(
            f"prompt must be a tinker.ModelInput (e.g. tinker.ModelInput.from_ints(token_ids)), got "
            f"{type(prompt).__name__}"
        )
    try:
        return tuple(prompt.to_ints())
    except ValueError:
        kinds = sorted({type(chunk).__name__ for chunk in prompt.chunks})
        raise NotImplementedError(
            f"this prompt holds {', '.join(kinds)} chunks; lora_sampler.tinker sends token ids to vLLM's "
            "/v1/completions, so only EncodedTextChunk is served"
        ) from None


def sampling_params(params: object) -> Tuple[SamplingParams, Optional[Dict[str, Any]]]:
    """Return the client's ``SamplingParams`` for Tinker's, and the extra body fields they need (or None).

    Tinker's ``stop=None`` keeps the end-of-sequence stop; ``stop=[]`` stops at nothing but ``max_tokens`` (vLLM's
    ``ignore_eos``); strings are stop strings and ints stop token ids (vLLM's ``stop_token_ids``). ``max_tokens=None``
    is sent as null: vLLM then generates until the context is full.

    Raises:
        TypeError: ``params`` is not a ``tinker.SamplingParams``.
        ValueError: a value the client refuses (each names the field).
    """
    if not isinstance(params, tinker.SamplingParams):
        raise TypeError(f"sampling_params must be a tinker.SamplingParams, got {type(params).__name__}")
    stop: Any = params.stop  # a str, a list of str or of ints, or None (tinker.SamplingParams.stop)
    extra = None
    if stop is not None and not isinstance(stop, str):
        stop = list(stop)
        if not stop:
            stop, extra = None, dict(IGNORE_EOS)
    ours = SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=stop,
    )
    return ours, extra


def stop_reason(finish_reason: str) -> Literal["length", "stop"]:
    """Tinker's stop reason for vLLM's ``finish_reason``: ``"length"``, or ``"stop"`` (a stop string, token or EOS)."""
    return "length" if finish_reason == "length" else "stop"


def sample_response(output: SampleOutput, *, topk_prompt: int, topk_sample: int, last_n: Optional[int]) -> Any:
    """Return the ``tinker.SampleResponse`` of one answer (float32 logprobs and int32 tokens, as Tinker's are).

    Args:
        output: The client's answer.
        topk_prompt: The ``topk_prompt_logprobs`` asked for (0: none).
        topk_sample: The ``topk_sample_logprobs`` asked for (0: none).
        last_n: Tinker's ``prompt_logprobs_last_n``: positions before the last ``last_n`` read None.
    """
    body = output.body or {}
    answer_id = str(body.get("id") or "sample")
    sequences = [
        tinker.SampledSequence(
            stop_reason=stop_reason(sequence.stop_reason),
            sequence_id=f"{answer_id}-{index}",
            tokens_np=np.asarray(sequence.tokens, dtype=np.int32),
            logprobs_np=np.asarray(sequence.logprobs, dtype=np.float32),
            topk_logprobs_np=None if not topk_sample else topk_matrices(sequence.topk_logprobs or (), topk_sample),
        )
        for index, sequence in enumerate(output.sequences)
    ]
    prompt_np = None
    if output.prompt_logprobs is not None:
        prompt_np = np.asarray(_masked(output.prompt_logprobs, last_n, math.nan), dtype=np.float32)
    topk_np = None
    if topk_prompt and output.topk_prompt_logprobs is not None:
        topk_np = topk_matrices(_masked(list(output.topk_prompt_logprobs), last_n, None), topk_prompt)
    usage = output.usage
    return tinker.SampleResponse(
        sequences=sequences,
        prompt_logprobs_np=prompt_np,
        topk_prompt_logprobs_np=topk_np,
        prompt_cache_hit_tokens=(usage.cached_tokens or 0) if usage is not None else 0,
    )


def _masked(values: Sequence[Any], last_n: Optional[int], blank: Any) -> List[Any]:
    """``values`` with None as ``blank``, and every position before the last ``last_n`` blanked too."""
    keep_from = 0 if last_n is None else len(values) - last_n
    return [blank if value is None or position < keep_from else value for position, value in enumerate(values)]


def topk_matrices(positions: Sequence[Optional[TopK]], k: int) -> TopkLogprobs:
    """Tinker's dense ``(length, k)`` matrices of top-k pairs; an empty slot holds token 0 and Tinker's mask value."""
    ids = np.zeros((len(positions), k), dtype=np.int32)
    logprobs = np.full((len(positions), k), MASK_LOGPROB, dtype=np.float32)
    for row, pairs in enumerate(positions):
        for column, (token, logprob) in enumerate((pairs or ())[:k]):
            ids[row, column], logprobs[row, column] = token, logprob
    return TopkLogprobs(token_ids=ids, logprobs=logprobs)


def checked_last_n(last_n: Optional[int], include_prompt_logprobs: bool, length: int) -> Optional[int]:
    """Check Tinker's ``prompt_logprobs_last_n`` as its server does: 1..len(prompt)-1, with prompt logprobs asked.

    Raises:
        ValueError: naming the value and its bounds.
    """
    if last_n is None:
        return None
    if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= length - 1:
        raise ValueError(
            f"prompt_logprobs_last_n must be an int from 1 to len(prompt) - 1 = {length - 1}, got {last_n!r}"
        )
    if not include_prompt_logprobs:
        raise ValueError("prompt_logprobs_last_n applies to prompt logprobs; set include_prompt_logprobs")
    return last_n
