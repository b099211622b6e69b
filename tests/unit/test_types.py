"""Value types: validation before any request, payloads, and reading vLLM answers."""

from __future__ import annotations

import math
import pathlib
import re
from typing import Any

import pytest

import lora_sampler
from lora_sampler import Adapter, GeneratedSequence, SampleOutput, SampleRequest, SamplingParams, ScoreOutput
from lora_sampler.batch import SweepSettings
from lora_sampler.publish import PublishLimits
from lora_sampler.ray_data import ClientSettings
from lora_sampler.types import checked_seconds, is_checkpoint_path


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"prompt": [1]}, ValueError, "adapter"),
        ({"prompt": [1], "adapter": "a", "base_model": "b"}, ValueError, "base_model"),
        ({"prompt": [1], "adapter": "a", "num_samples": 0}, ValueError, "num_samples"),
        ({"prompt": [1], "adapter": "a", "num_samples": 1.5}, ValueError, "num_samples"),
        ({"prompt": [1, "2"], "adapter": "a"}, TypeError, "token ids"),
        ({"prompt": [1, 2.0], "adapter": "a"}, TypeError, "token ids"),
        ({"prompt": [True], "adapter": "a"}, TypeError, "token ids"),
        ({"prompt": [-1], "adapter": "a"}, ValueError, "token ids"),
        ({"prompt": [], "adapter": "a"}, ValueError, "prompt"),
        ({"prompt": "", "adapter": "a"}, ValueError, "prompt"),
        ({"prompt": 5, "adapter": "a"}, TypeError, "prompt"),
        ({"prompt": [1], "adapter": 5}, TypeError, "adapter"),
        ({"prompt": [1], "adapter": "a", "sampling_params": {"max_tokens": 3}}, TypeError, "sampling_params"),
        ({"prompt": [1], "adapter": "a", "topk_prompt_logprobs": -1}, ValueError, "topk_prompt_logprobs"),
    ],
)
def test_types_bad_request_raises_naming_the_argument(kwargs: Any, error: type, names: str) -> None:
    """Bad sample arguments raise ValueError/TypeError naming the argument."""
    with pytest.raises(error, match=names):
        SampleRequest(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"max_tokens": -1}, ValueError, "max_tokens"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"top_p": 0}, ValueError, "top_p"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"seed": "1"}, TypeError, "seed"),
        ({"stop": 1.5}, TypeError, "stop"),
        ({"stop": [b"x"]}, TypeError, "stop"),
        ({"stop": {"a"}}, TypeError, "stop"),
        ({"stop": [True]}, TypeError, "stop"),
    ],
)
def test_types_bad_sampling_params_raise_naming_the_argument(kwargs: Any, error: type, names: str) -> None:
    """Bad sampling parameters raise ValueError/TypeError naming the argument."""
    with pytest.raises(error, match=names):
        SamplingParams(**kwargs)


def test_types_payload_carries_every_field() -> None:
    """Everything the user set reaches the payload; stop strings and stop ids go to their own fields."""
    params = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["\n", 2, "END"])
    request = SampleRequest([1, 2], adapter="a", num_samples=3, sampling_params=params, topk_prompt_logprobs=2)
    assert request.to_payload("a") == {
        "model": "a",
        "prompt": [1, 2],
        "n": 3,
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop": ["\n", "END"],
        "stop_token_ids": [2],
        "logprobs": 1,
        "return_token_ids": True,
        "prompt_logprobs": 2,
    }


def test_types_payload_omits_prompt_logprobs_unless_asked() -> None:
    """Text prompts pass through and prompt_logprobs is only sent when asked (0 = the tokens' own)."""
    assert "prompt_logprobs" not in SampleRequest("hi", base_model="b").to_payload("b")
    assert SampleRequest("hi", base_model="b", prompt_logprobs=True).to_payload("b")["prompt_logprobs"] == 0


def test_types_output_reads_choices_and_trims_topk() -> None:
    """Sequences come in index order; prompt logprobs pick the prompt token; top-k is trimmed to k."""
    body = {
        "model": "a",
        "choices": [
            {
                "index": 1,
                "text": "y",
                "token_ids": [9],
                "finish_reason": "stop",
                "stop_reason": 9,
                "logprobs": {"token_logprobs": [-2.0]},
                "prompt_logprobs": None,
                "prompt_token_ids": [5, 6],
            },
            {
                "index": 0,
                "text": "x",
                "token_ids": [8],
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": {"token_logprobs": [-1.0]},
                "prompt_token_ids": [5, 6],
                "prompt_logprobs": [
                    None,
                    {
                        "6": {"logprob": -3.0, "rank": 3},
                        "1": {"logprob": -0.1, "rank": 1},
                        "2": {"logprob": -0.2, "rank": 2},
                    },
                ],
            },
        ],
    }
    request = SampleRequest([5, 6], adapter="a", num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2)
    output = SampleOutput.from_json(body, request)
    assert [s.tokens for s in output.sequences] == [(8,), (9,)]
    assert output.sequences[1].stop_reason == "stop" and output.sequences[1].matched_stop == 9
    assert output.prompt_logprobs == (None, -3.0)
    assert output.topk_prompt_logprobs == (None, ((1, -0.1), (2, -0.2)))


def test_types_output_rejects_a_body_without_choices() -> None:
    """A 200 that is not a completion is a clear error, not an empty result."""
    with pytest.raises(ValueError, match="choices"):
        SampleOutput.from_json({"detail": "hello"}, SampleRequest([1], base_model="b"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("step-400", False),
        ("runs/step-400", True),
        ("./step-1", True),
        ("step.tar.gz", True),
        ("a.tgz", True),
        ("a.tar", True),
        ("step-400.tar.xz", True),
        ("step-400.tar.bz2", True),
        ("step-400.txz", True),
        ("step-400.tbz2", True),
        ("STEP.TAR.GZ", True),
        (pathlib.Path("step"), True),
        (Adapter("x"), False),
    ],
)
def test_types_checkpoint_paths_are_told_from_names(value: Any, expected: bool) -> None:
    """Paths, PathLikes and archive names are checkpoints; bare words are adapter names."""
    assert is_checkpoint_path(value) is expected


def test_types_a_logprob_above_zero_after_a_null_is_refused() -> None:
    """A null logprob (read as NaN) does not hide a later one above 0 (before: ``max`` met the NaN first and
    passed the answer)."""
    choice = {"index": 0, "text": "x", "token_ids": [1, 2], "logprobs": {"token_logprobs": [None, 5.0]}}
    with pytest.raises(ValueError, match=r"holds 5\.0 at position 1: a logprob is never above 0"):
        SampleOutput.from_json({"model": "b", "choices": [choice]}, SampleRequest([1], base_model="b"))
    choice["logprobs"] = {"token_logprobs": [None, -5.0]}
    output = SampleOutput.from_json({"model": "b", "choices": [choice]}, SampleRequest([1], base_model="b"))
    assert math.isnan(output.sequences[0].logprobs[0]) and output.sequences[0].logprobs[1] == -5.0


def test_types_a_sum_below_the_float_range_shows_as_minus_infinity() -> None:
    """Logprobs whose sum leaves the float range (-1e308 twice) show as -inf in a repr and the notebook table, as a
    score's total is (before: the repr raised OverflowError, as the total once did)."""
    sequence = GeneratedSequence((1, 2), (-1e308, -1e308), "stop")
    assert "logprob=-inf" in repr(sequence)
    assert "<td>-inf</td>" in SampleOutput((sequence,), model="m")._repr_html_()
    assert ScoreOutput((1, 2, 3), (None, -1e308, -1e308), 1).total == -math.inf
    assert math.isnan(ScoreOutput((1, 2, 3), (None, -1.0, math.nan), 1).total)  # a NaN sent is not summed away


@pytest.mark.parametrize("counts", [{"prompt_tokens": [1]}, {"prompt_tokens": "12"}, {"total_tokens": {"a": 1}}])
def test_types_a_usage_that_is_no_counts_reads_as_none(counts: Any) -> None:
    """A usage whose counts are not whole numbers reads as no usage, so the result still shows and converts (before:
    ``output.usage`` and ``to_dict()`` raised TypeError or ValueError); whole counts read as sent."""
    choice = {"index": 0, "text": "x", "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}
    request = SampleRequest([1], base_model="b")
    output = SampleOutput.from_json({"model": "b", "choices": [choice], "usage": counts}, request)
    assert output.usage is None and output.to_dict()["usage"] is None
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}}
    output = SampleOutput.from_json({"model": "b", "choices": [choice], "usage": usage}, request)
    assert output.to_dict()["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "cached_tokens": 2,
    }


@pytest.mark.parametrize(
    "make, name, least",
    [
        (lambda v: lora_sampler.RetryPolicy(max_attempts=v), "max_attempts", 1),
        (lambda v: PublishLimits(max_members=v), "PublishLimits(max_members=...)", 1),
        (lambda v: lora_sampler.SamplerClient("http://127.0.0.1:9", max_workers=v), "max_workers", 1),
        (lambda v: lora_sampler.SamplerClient("http://127.0.0.1:9", max_response_bytes=v), "max_response_bytes", 1),
        (lambda v: SamplingParams(max_tokens=v), "max_tokens", 1),
        (lambda v: ClientSettings("http://127.0.0.1:9", max_workers=v), "max_workers", 1),
        (lambda v: SweepSettings(output_dir="out", window=v), "window", 1),
    ],
)
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_every_count_a_caller_passes_is_refused_by_one_rule_naming_it(
    make: Any, name: str, least: int, bad: Any
) -> None:
    """A count (attempts, workers, bytes, members, tokens) that is not an int >= its least, a bool included, is a
    ValueError naming the argument, in the same words wherever it is passed."""
    with pytest.raises(ValueError, match=re.escape(f"{name} must be an int >= {least}")):
        make(bad)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda v: lora_sampler.RetryPolicy(load_timeout=v), "load_timeout"),
        (lambda v: ClientSettings("http://127.0.0.1:9", max_outage=v), "max_outage"),
        (lambda v: SweepSettings(output_dir="out", settle=v), "settle"),
        (lambda v: lora_sampler.SamplerClient("http://127.0.0.1:9").wait_ready(timeout=v), "timeout"),
    ],
)
@pytest.mark.parametrize("bad", [-1, math.nan, -math.inf, True, "3", None])
def test_every_duration_a_caller_passes_is_refused_by_one_rule_naming_it(make: Any, name: str, bad: Any) -> None:
    """A duration (a delay, a hold, a wait) that is not a number of seconds >= 0, NaN and a bool included, is a
    ValueError naming the argument, in the same words wherever it is passed."""
    with pytest.raises(ValueError, match=re.escape(f"{name} must be a number of seconds >= 0")):
        make(bad)


def test_a_duration_beyond_the_float_range_is_for_ever() -> None:
    """A whole number of seconds too large for a float is infinity, not an OverflowError: also a ``RetryPolicy``'s,
    which a client then takes."""
    assert checked_seconds(10**400, "max_outage") == math.inf
    policy = lora_sampler.RetryPolicy(max_delay=10**400)
    assert policy.max_delay == math.inf
    lora_sampler.SamplerClient("http://127.0.0.1:9", retry=policy).close()  # it raised OverflowError


@pytest.mark.parametrize(
    "fields, refusal",
    [
        ({"base_delay": math.inf, "max_delay": math.inf}, "base_delay must be a finite number of seconds >= 0"),
        ({"base_delay": 10**400, "max_delay": 10**400}, "base_delay must be a finite number of seconds >= 0"),
        ({"load_timeout": math.inf}, "load_timeout must be a finite number of seconds > 0"),
        ({"load_timeout": 10**400}, "load_timeout must be a finite number of seconds > 0"),
        ({"load_timeout": 0}, "load_timeout must be a finite number of seconds > 0"),
    ],
)
def test_a_retry_policy_refuses_an_infinite_first_wait_and_load_timeout(fields: Any, refusal: str) -> None:
    """An infinite first wait would be jittered into NaN (``time.sleep`` then raises), and the load request's timeout
    is a request timeout (requests raises OverflowError for inf, ValueError for 0): both are refused when the policy
    is made, naming the field. Both were taken before."""
    with pytest.raises(ValueError, match=re.escape(refusal)):
        lora_sampler.RetryPolicy(**fields)


@pytest.mark.parametrize("bad", [0, -1, (0, 5), (1, 2, 3), "abc", math.inf, math.nan, True, (10, None)])
@pytest.mark.parametrize(
    "make",
    [
        lambda v: lora_sampler.SamplerClient("http://127.0.0.1:9", timeout=v),
        lambda v: lora_sampler.SamplerClient("http://127.0.0.1:9", replicas=["http://127.0.0.1:8"], timeout=v),
        lambda v: SampleRequest([1], base_model="m", timeout=v),
    ],
)
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_where_it_is_given(make: Any, bad: Any) -> None:
    """A client's or a request's timeout (one number, or (connect, read)) of 0, a negative, a non-number or a
    pair that is not two positive finite numbers is a ValueError naming ``timeout``, when it is given, not at the
    first request."""
    with pytest.raises(ValueError, match=re.escape("timeout takes seconds > 0")):
        make(bad)


def test_a_client_takes_one_number_or_a_connect_read_pair_as_its_timeout() -> None:
    """The forms the docs give are accepted (the check refuses none of them)."""
    for timeout in (5, 2.5, (10, 300), (0.5, 1)):
        with lora_sampler.SamplerClient("http://127.0.0.1:9", timeout=timeout) as client:
            assert client.base_url == "http://127.0.0.1:9"
