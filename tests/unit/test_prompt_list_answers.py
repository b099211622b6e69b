"""How a prompt list's answer is split per prompt: too few choices name the setting that sends one prompt a request;
choices are read in index order."""

from __future__ import annotations

import pytest

from lora_sampler._wire.answers import choices_of, prompt_parts


def test_too_few_choices_for_a_prompt_list_names_prompts_per_request_1() -> None:
    """An engine that answers only the first prompt of a list: the error names prompts_per_request=1 and its flag."""
    body = {"model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
    with pytest.raises(ValueError, match=r"prompts_per_request=1 \(--prompts-per-request 1\)"):
        prompt_parts(body, [[1, 2], [3, 4]], 1, "m")


def _echoing(index: int, prompt: list) -> dict:
    return {"index": index, "text": "a", "token_ids": [index], "prompt_token_ids": prompt, "finish_reason": "length"}


def test_choices_are_read_in_index_order_and_refused_unless_each_index_once() -> None:
    """A prompt list's choices (and one request's) come back in index order whatever order they were sent in; indices
    that do not number them 0..N-1 once each are refused, for a list and for one request alike."""
    shuffled = {"model": "m", "choices": [_echoing(1, [3, 4]), _echoing(0, [1, 2])]}
    parts = prompt_parts(shuffled, [[1, 2], [3, 4]], 1, "m")
    assert [part["choices"][0]["token_ids"] for part in parts] == [[0], [1]]
    assert [choice["index"] for choice in choices_of(shuffled, 2, "m")] == [0, 1]
    twice = {"model": "m", "choices": [_echoing(1, [1, 2]), _echoing(1, [3, 4])]}
    with pytest.raises(ValueError, match=r"choice indices are not 0\.\.1 once each"):
        prompt_parts(twice, [[1, 2], [3, 4]], 1, "m")
    with pytest.raises(ValueError, match=r"choice indices are not 0\.\.1 once each"):
        choices_of(twice, 2, "m")
