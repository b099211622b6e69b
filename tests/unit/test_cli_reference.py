"""The command line's documentation is its parser's: docs/reference/cli.md (every command, argument, default and help)
and the CLI guide's command table are what tools/cli_reference.py writes from ``build_parser()``, or this test fails
naming that command."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lora_sampler.cli._main import LM_EVAL_COMMAND, build_parser

ROOT = Path(__file__).resolve().parents[2]
#: Every command of the parser.
COMMANDS = sorted(build_parser().commands.choices)


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tool = load_tool()


@pytest.mark.parametrize("path", sorted(tool.expected()), ids=lambda path: str(path.relative_to(ROOT)))
def test_cli_docs_are_what_the_parser_says(path: Path) -> None:
    """Each generated file holds exactly what the parser gives; a flag added, removed or reworded fails here."""
    assert (
        path.read_text(encoding="utf-8") == tool.expected()[path]
    ), f"{path.relative_to(ROOT)} differs from the parser: run `python tools/cli_reference.py` and commit the result"


def test_cli_guide_holds_the_command_table_between_its_markers() -> None:
    """The guide's markers are there (without them the rewrite would have nothing to replace, and pass)."""
    found = tool.GUIDE_TABLE.search(tool.GUIDE.read_text(encoding="utf-8"))
    assert found and found["table"] == tool.command_table(build_parser())


def test_command_table_names_every_command_and_each_has_its_function() -> None:
    """Every command main runs is a row (serve-test-engine and adapters included), and each holds the function that
    runs it: all but lm-eval, whose arguments main hands to lm-eval unparsed."""
    parser = build_parser()
    table = tool.command_table(parser)
    assert all(f"`lora-sampler {name}`" in table for name in COMMANDS)
    unrun = [name for name, command in parser.commands.choices.items() if not callable(command.get_default("run"))]
    assert unrun == [LM_EVAL_COMMAND]


@pytest.mark.parametrize("name", COMMANDS)
def test_reference_lists_every_flag_the_usage_shows(name: str) -> None:
    """Every flag argparse's usage line shows is one the parser knows and a row of the command's table, a mutually
    exclusive group's included (a flag added some way the parser does not see would be missing from the reference
    and from the "did you mean")."""
    command = build_parser().commands.choices[name]
    shown = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", command.format_usage()))
    known = {action.option_strings[0] for action in command.arguments if action.option_strings}
    assert shown == known
    rows = tool.flag_table(command).splitlines()
    assert all(any(f"`{flag}" in row for row in rows) for flag in known - {"-h"})


def test_a_help_with_a_pipe_a_newline_or_a_tag_stays_one_table_cell() -> None:
    """Help text is written as one cell: a ``|`` would split the row, a newline end it, ``<adapter>`` vanish as HTML."""
    from lora_sampler.cli._parser import CommandParser

    parser = CommandParser(prog="x", add_help=False)
    parser.add_argument("--out", default="a|b", help="writes DIR/<adapter>.jsonl |\n  one per checkpoint")
    row = tool.flag_table(parser).splitlines()[-1]
    assert row == r"| `--out OUT` | `a\|b` | writes DIR/&lt;adapter>.jsonl \| one per checkpoint |"
