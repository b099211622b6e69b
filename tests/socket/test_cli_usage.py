"""Usage mistakes are one line naming the flag to change, with a "did you mean" for a mistyped one."""

from __future__ import annotations

from typing import Any

import pytest

from lora_sampler.cli import main


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        (("--num_samples", "4"), "did you mean --num-samples?"),
        (("-n", "4"), "use --num-samples"),
        (("--model", "m"), "use --adapter"),
        (("--temprature", "0"), "did you mean --temperature?"),
    ],
)
def test_cli_mistyped_flag_says_what_was_meant_in_one_line(capsys: Any, typed: Any, meant: str) -> None:
    """A flag `sample` does not take is named with the flag it likely meant, in one line, exit 2."""
    argv = ["sample", "--base-url", "http://127.0.0.1:9", "--base-model", "m", "--input", "in.jsonl", *typed]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unknown flag {typed[0]}" in err and meant in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["score", "--base-url", "u", "-i", "a", "-o", "b", "--base-model", "m", "--adpater", "a"], "--adapter"),
        (["sample", "--base-url", "u", "-i", "a", "--adapter", "a", "--base-modle", "m"], "--base-model"),
        (
            ["sweep", "--base-url", "u", "--output-dir", "d", "--input", "x", "--checkpoints", "c", "--manfest", "m"],
            "--manifest",
        ),
    ],
)
def test_cli_mistyped_flag_of_a_choose_one_group_is_suggested(capsys: Any, argv: Any, meant: str) -> None:
    """A flag of a mutually exclusive group (--adapter or --base-model, --checkpoints or --manifest) is among those
    a slip is matched to (they were missed: --adpater was taken for --mix-adapters)."""
    assert main(argv) == 2
    assert f"did you mean {meant}?" in capsys.readouterr().err


def test_cli_missing_base_url_is_one_line_naming_it(capsys: Any) -> None:
    """A missing required flag is one line naming it and where the help is, not the 17-line usage."""
    assert main(["sample", "--input", "in.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--base-url" in err and "lora-sampler sample --help" in err


def test_cli_help_still_prints_the_usage(capsys: Any) -> None:
    """--help prints the whole help and exits 0."""
    assert main(["sample", "--help"]) == 0
    assert "--num-samples" in capsys.readouterr().out
