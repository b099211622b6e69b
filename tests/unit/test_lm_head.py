"""Which adapter configs target ``lm_head`` (scoring flags them): list entries, peft regexes, ``all-linear``."""

from __future__ import annotations

import json
from pathlib import Path
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


def test_adapter_folder_targets_lm_head_only_when_its_config_is_a_lora(tmp_path: Path) -> None:
    """A folder's config is read as the preflight reads it: a LoRA on lm_head is flagged; no folder, no config,
    broken JSON or a config vLLM would not serve (not a LoRA) is not."""
    from lora_sampler._adapters.publish import adapter_targets_lm_head

    def folder(name: str, text: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(text)
        return path

    lora = {"peft_type": "LORA", "base_model_name_or_path": "m", "target_modules": ["q_proj", "lm_head"]}
    assert adapter_targets_lm_head(folder("lora", json.dumps(lora)))
    assert not adapter_targets_lm_head(folder("ia3", json.dumps({**lora, "peft_type": "IA3"})))
    assert not adapter_targets_lm_head(folder("broken", "{"))
    assert not adapter_targets_lm_head(tmp_path / "missing")
    assert not adapter_targets_lm_head(None)
