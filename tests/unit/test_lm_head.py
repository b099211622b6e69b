"""Which adapter configs target ``lm_head`` (scoring flags them): list entries, peft regexes, ``all-linear``."""

from __future__ import annotations

from typing import Any

import pytest

from lora_sampler._adapters.publish import targets_lm_head


@pytest.mark.parametrize(
    "targets, expected",
    [
        (["q_proj", "v_proj"], False),
        (["q_proj", "lm_head"], True),
        (["model.lm_head"], True),
        ("lm_head", True),
        (".*(q_proj|lm_head)", True),
        ("all-linear", False),
        ("q_proj", False),
        ("(unclosed", False),
        (None, False),
        (42, False),
    ],
)
def test_targets_lm_head(targets: Any, expected: bool) -> None:
    """target_modules naming the output layer, as a list entry or a regex peft matches in full, are flagged."""
    assert targets_lm_head({"target_modules": targets}) is expected
