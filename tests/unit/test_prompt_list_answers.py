"""A prompt list answered with too few choices says which setting sends one prompt a request."""

from __future__ import annotations

import pytest

from lora_sampler._wire.answers import prompt_parts


def test_too_few_choices_for_a_prompt_list_names_prompts_per_request_1() -> None:
    """An engine that answers only the first prompt of a list: the error names prompts_per_request=1 and its flag."""
    body = {"model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
    with pytest.raises(ValueError, match=r"prompts_per_request=1 \(--prompts-per-request 1\)"):
        prompt_parts(body, [[1, 2], [3, 4]], 1, "m")
