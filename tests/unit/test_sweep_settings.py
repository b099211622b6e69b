"""``SweepSettings`` is the one spelling of a sweep's settings: the command line's flags, the Python call and the
guide's table are built from its fields, and each value is checked once, in the value."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from lora_sampler import SweepSettings, sweep
from lora_sampler.batch._settings import setting_of
from lora_sampler.cli import build_parser
from lora_sampler.cli._settings_flags import flag_fields, settings_from

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sweeps.md"
TABLE = re.compile(r"<!-- settings table: .*? -->\n(?P<table>.*?)\n<!-- end of the settings table -->", re.S)


def settings_table() -> str:
    """The guide's table of settings, as the fields say it should read."""
    rows = ["| setting | flag | default | what it sets |", "| --- | --- | --- | --- |"]
    for item in dataclasses.fields(SweepSettings):
        flag = setting_of(item).flag_of(item.name)
        default = "required" if item.default is dataclasses.MISSING else f"`{item.default!r}`"
        flag_cell = f"`{flag}`" if flag else "Python only"
        rows.append(f"| `{item.name}` | {flag_cell} | {default} | {setting_of(item).help} |")
    return "\n".join(rows)


def test_the_guide_lists_every_setting_as_the_fields_say() -> None:
    """docs/guides/sweeps.md's table is the fields' (add a field, and this test prints the table to paste)."""
    found = TABLE.search(GUIDE.read_text(encoding="utf-8"))
    assert found, "docs/guides/sweeps.md has no settings table between its markers"
    assert found["table"] == settings_table(), "paste this table into docs/guides/sweeps.md:\n" + settings_table()


#: A value for each kind of flag, and what the value holds then.
SAMPLES = {int: ("3", 3), float: ("0.5", 0.5), dict: ('{"min_tokens": 4}', {"min_tokens": 4}), list: ("X", ["X"])}
#: Text settings, by name: the text, and the value it becomes.
TEXT_SAMPLES = {"lm_eval_tasks": ("t1,t2", ("t1", "t2")), "lm_eval_include_path": ("tasks/", "tasks/")}
#: The lm-eval settings go with the tasks to run.
LM_EVAL_BASE = ["--lm-eval-tasks", "t"]
BASE = ["sweep", "--base-url", "http://x", "--checkpoints", "a", "--input", "i", "--output-dir", "o"]


def test_every_setting_is_a_flag_of_sweep_and_a_keyword_of_the_python_call() -> None:
    """Each field reaches ``sweep()``'s keywords, and its flag (all but Python-only values) reaches the value."""
    keywords = inspect.signature(sweep).parameters
    for item in dataclasses.fields(SweepSettings):
        assert item.name in keywords, item.name
        flag = setting_of(item).flag_of(item.name)
        if flag is None:
            assert item.name in ("sampling_params", "storage_options"), item.name
            continue
        if item.name == "output_dir":
            continue
        text, value = SAMPLES.get(setting_of(item).value, (None, True))
        if item.name in TEXT_SAMPLES:
            text, value = TEXT_SAMPLES[item.name]
        base = BASE + LM_EVAL_BASE if item.name.startswith("lm_eval_") and item.name != "lm_eval_tasks" else BASE
        given = settings_from(build_parser().parse_args([*base, flag] + ([text] if text is not None else [])))
        assert getattr(given, item.name) == value, item.name
    assert "output_dir" in flag_fields()


def test_the_command_line_defaults_are_the_settings_defaults() -> None:
    """Parsed with no setting flag, the command line's settings are the value's defaults (but the outage hold)."""
    args = build_parser().parse_args(BASE)
    from_flags = settings_from(args)
    assert dataclasses.replace(from_flags, max_outage=0.0) == SweepSettings("o")
    assert from_flags.max_outage == 600.0


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--window", "0"], "--window must be an int >= 1"),
        (["--settle", "-1"], "--settle must be a number of seconds >= 0"),
        (["--keep-loaded", "--delete-retired"], "it cannot go with --keep-loaded"),
        (
            ["--prompts-per-request", "0"],
            "--prompts-per-request must be 1 (one prompt per request) or an int up to 1024, got 0; leave the flag "
            "out for the measured defaults",
        ),
        (["--score", "--max-tokens", "3"], "--score scores each line; sampling settings apply to sampling only"),
        (["--top-p", "2"], "--top-p must be a number in (0, 1]"),
    ],
)
def test_a_bad_setting_is_refused_once_in_the_value_naming_its_flag(flags: Any, phrase: str) -> None:
    """The value's check, in the command line's words; the same value from Python names the keyword."""
    args = build_parser().parse_args([*BASE, *flags])
    with pytest.raises(ValueError) as error:
        settings_from(args)
    assert phrase in str(error.value), str(error.value)


def test_python_overrides_are_settings_or_a_did_you_mean() -> None:
    """``sweep(..., windw=2)``: a TypeError naming the closest setting, before any request."""
    with pytest.raises(TypeError, match="did you mean window"):
        SweepSettings.of(output_dir="o", windw=2)
    with pytest.raises(TypeError, match="needs output_dir"):
        SweepSettings.of(window=2)
    with pytest.raises(TypeError, match="pass the output folder as output_dir='evals'"):
        SweepSettings.of("evals")  # type: ignore[arg-type]  (the fourth positional argument taken for output_dir)
    base = SweepSettings("o", window=3)
    assert SweepSettings.of(base, watch=True) == SweepSettings("o", window=3, watch=True)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SweepSettings.of(base, window=0)
