"""The CLI guide's command table is the parser's: a command added or reworded shows up there, or this test fails."""

from __future__ import annotations

import re
from pathlib import Path

from lora_sampler.cli._main import COMMANDS, build_parser

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "cli.md"
TABLE = re.compile(r"<!-- command table: .*? -->\n(?P<table>.*?)\n<!-- end of the command table -->", re.S)


def test_cli_guide_lists_every_command_as_the_parser_says() -> None:
    """docs/guides/cli.md's table is ``build_parser().command_table()`` (this test prints the table to paste)."""
    table = build_parser().command_table()
    found = TABLE.search(GUIDE.read_text(encoding="utf-8"))
    assert found, "docs/guides/cli.md has no command table between its markers"
    assert found["table"] == table, "paste this table into docs/guides/cli.md:\n" + table


def test_command_table_names_every_command() -> None:
    """Every command main runs is a row (serve-test-engine and adapters included)."""
    table = build_parser().command_table()
    assert all(f"`lora-sampler {name}`" in table for name in COMMANDS)
