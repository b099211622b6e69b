"""Scoring values and the decoding of prompt logprobs: ``ScoreRequest``, ``ScoreOutput``, ``PromptTopK``, ``_json``.

The decoder tests run with the standard library and, when the ``[fast]`` extra (msgspec) is installed, with it too:
both must give the same values for every answer.
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Any, Callable, Dict, List, Optional

import pytest

from lora_sampler import _json
from lora_sampler.types import PromptTopK, SampleOutput, SampleRequest, ScoreOutput, ScoreRequest

Decoder = Callable[[Any], Any]


def decoders() -> List[Any]:
    """The standard library's decoder, and the fast one when msgspec is installed (else a skipped case)."""
    fast = pytest.param(
        _json.loads,
        id="msgspec",
        marks=pytest.mark.skipif(_json.msgspec is None, reason="the [fast] extra (msgspec) is not installed"),
    )
    return [pytest.param(_json._stdlib_loads, id="stdlib"), fast]


def body(prompt: List[int], entries: List[Optional[Dict[str, Any]]], model: str = "m") -> Dict[str, Any]:
    """A vLLM completion answer with one generated token and these prompt logprobs."""
    choice = {
        "index": 0,
        "text": "x",
        "logprobs": {"token_logprobs": [-0.5], "tokens": ["x"], "text_offset": [0], "top_logprobs": [{"x": -0.5}]},
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [9],
        "prompt_logprobs": entries,
        "prompt_token_ids": prompt,
    }
    return {"id": "cmpl-1", "object": "text_completion", "model": model, "choices": [choice]}


def entry(own: int, rank: int, value: float, *top: int) -> Dict[str, Any]:
    """One position: the prompt token's own entry first, then ``top`` ranked 1.. (vLLM's order)."""
    found = {str(own): {"logprob": value, "rank": rank, "decoded_token": "o"}}
    for place, token in enumerate(top, 1):
        found.setdefault(str(token), {"logprob": -0.1 * place, "rank": place, "decoded_token": "t"})
    return found


def test_score_request_validates_like_sample_request() -> None:
    """Exactly one of adapter/base_model, non-empty prompt and completion of ids >= 0 or text, before any request."""
    with pytest.raises(ValueError, match="exactly one of adapter"):
        ScoreRequest([1, 2])
    with pytest.raises(ValueError, match="completion must not be empty"):
        ScoreRequest([1, 2], completion=[], base_model="b")
    with pytest.raises(ValueError, match=r"completion token ids must be >= 0, got -3 at position 1"):
        ScoreRequest("a", completion=[4, -3], base_model="b")
    with pytest.raises(TypeError, match=r"prompt token ids must be ints, got True at position 0"):
        ScoreRequest([True], base_model="b")
    request = ScoreRequest([1, 2], completion="x", adapter="a", session_id="s")
    assert request.prompt == (1, 2) and request.completion == "x"


def test_score_output_scores_tokens_after_start() -> None:
    """scored_* are the tokens from ``start`` on, and total is their fsum (0.0 when there are none)."""
    output = ScoreOutput((5, 6, 7, 8), (None, -1.0, -0.25, -0.5), 2, "m")
    assert output.scored_tokens == (7, 8) and output.scored_logprobs == (-0.25, -0.5)
    assert output.total == -0.75
    assert ScoreOutput((5,), (None,), 1).total == 0.0


@pytest.mark.parametrize("decode", decoders())
def test_from_json_prompt_logprobs_same_with_either_decoder(decode: Decoder) -> None:
    """Both decoders give the same SampleOutput (tokens' own logprobs and ranked top-k) as json.loads."""
    prompt = [5, 6, 7]
    entries = [None, entry(6, 3, -2.5, 40, 41), entry(7, 1, -0.1, 7, 50)]
    raw = json.dumps(body(prompt, entries)).encode()
    request = SampleRequest(prompt, base_model="m", prompt_logprobs=True, topk_prompt_logprobs=2)
    output = SampleOutput.from_json(decode(raw), request, model="m")
    reference = SampleOutput.from_json(json.loads(raw), request, model="m")
    assert output == reference
    assert output.prompt_logprobs == (None, -2.5, -0.1)
    assert output.topk_prompt_logprobs == (None, ((40, -0.1), (41, -0.2)), ((7, -0.1), (50, -0.2)))


@pytest.mark.parametrize("decode", decoders())
@pytest.mark.parametrize(
    "document",
    [
        b'{"big": 123456789012345678901234567890, "neg": -9223372036854775809}',
        b'{"s": "\\ud800", "e": "\\u00e9\\n", "x": 1e400}',
        b'{"a": 1, "a": 2, "f": [0.1, 5e-324, -0.0, 1.7976931348623157e308]}',
        '{"text": "caf\u00e9"}'.encode("utf-8"),
        '{"utf16": 1}'.encode("utf-16"),
    ],
)
def test_json_loads_equals_stdlib(decode: Decoder, document: bytes) -> None:
    """The decoder gives json.loads' value for what msgspec refuses or reads differently (NaN, big ints, UTF-16)."""
    expected, got = json.loads(document), decode(document)
    assert repr(got) == repr(expected)  # repr: NaN != NaN, and -0.0 == 0.0


@pytest.mark.parametrize("decode", decoders())
@pytest.mark.parametrize("document", [b'{"a": [NaN]}', b'{"a": Infinity}', b"[-Infinity]", b"[" * 100_000])
def test_json_loads_refuses_nan_infinity_and_deep_nesting(decode: Decoder, document: bytes) -> None:
    """NaN and Infinity (no JSON) and nesting too deep are a ValueError, where json.loads gives floats or recurses."""
    with pytest.raises(ValueError, match=r"not JSON|nested too deep"):
        decode(document)


@pytest.mark.parametrize("decode", decoders())
def test_json_loads_refuses_what_stdlib_refuses(decode: Decoder) -> None:
    """A document json.loads refuses is a ValueError with its message (the transport turns it into a protocol error)."""
    with pytest.raises(ValueError, match="Expecting"):
        decode(b'{"a": ')


def test_from_json_reads_topk_positions_only_when_read() -> None:
    """A malformed position deep in an answer does not fail the decode; reading it raises ValueError naming it."""
    prompt = [5, 6, 7, 8]
    entries: List[Optional[Dict[str, Any]]] = [None, entry(6, 1, -0.5, 6), entry(7, 1, -0.5, 7), entry(8, 1, -0.3, 8)]
    entries[3][str(8)] = {"logprob": -0.3, "rank": 1}
    entries[3]["99"] = {"rank": 2}  # no logprob: malformed, but only for whoever reads position 3's top-k
    request = SampleRequest(prompt, base_model="m", topk_prompt_logprobs=2)
    output = SampleOutput.from_json(body(prompt, entries), request, model="m")
    assert output.topk_prompt_logprobs is not None and len(output.topk_prompt_logprobs) == 4
    assert output.topk_prompt_logprobs[1] == ((6, -0.5),)
    with pytest.raises(ValueError, match="prompt logprobs at position 3 are malformed"):
        output.topk_prompt_logprobs[3]


def test_prompt_topk_view_behaves_as_a_tuple() -> None:
    """PromptTopK: len, negative indices, slices, equality with tuples both ways, hash, repr and pickling."""
    view = PromptTopK([None, entry(6, 2, -1.0, 40), entry(7, 1, -0.1, 7)], 1)
    as_tuple = (None, ((40, -0.1),), ((7, -0.1),))
    assert len(view) == 3 and view[-1] == ((7, -0.1),) and view[1:] == as_tuple[1:]
    assert view == as_tuple and as_tuple == view and view == list(as_tuple) and view != as_tuple[:2]
    assert hash(view) == hash(as_tuple) and repr(view) == repr(as_tuple)
    assert pickle.loads(pickle.dumps(view)) == as_tuple


def test_from_json_refuses_prompt_logprobs_without_the_tokens_own() -> None:
    """A position lacking the prompt token's own entry, or a count unlike the prompt's, is refused (not None)."""
    prompt = [5, 6, 7]
    request = SampleRequest(prompt, base_model="m", prompt_logprobs=True)
    with pytest.raises(ValueError, match=r"position 2 lack prompt token 7's own entry"):
        SampleOutput.from_json(body(prompt, [None, entry(6, 1, -0.5), entry(70, 1, -0.5)]), request)
    with pytest.raises(ValueError, match=r"position 1 lack prompt token 6's own entry"):
        SampleOutput.from_json(body(prompt, [None, None, entry(7, 1, -0.5)]), request)
    with pytest.raises(ValueError, match="2 prompt logprobs for 3 prompt tokens"):
        SampleOutput.from_json(body(prompt, [None, entry(6, 1, -0.5)]), request)
    topk_only = SampleRequest(prompt, base_model="m", topk_prompt_logprobs=1)
    with pytest.raises(ValueError, match="2 prompt logprobs for 3 prompt tokens"):
        SampleOutput.from_json(body(prompt, [None, entry(6, 1, -0.5)]), topk_only)


def test_from_json_keeps_vllm_clamped_logprobs() -> None:
    """vLLM's clamped -inf (-9999.0) is a number like any other; NaN from a lenient JSON stays NaN."""
    prompt = [5, 6, 7]
    request = SampleRequest(prompt, base_model="m", prompt_logprobs=True)
    decoded = json.loads(json.dumps(body(prompt, [None, entry(6, 9, -9999.0), entry(7, 1, float("nan"))])))
    output = SampleOutput.from_json(decoded, request)
    assert output.prompt_logprobs is not None
    assert output.prompt_logprobs[1] == -9999.0 and math.isnan(output.prompt_logprobs[2] or 0.0)
