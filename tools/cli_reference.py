"""Write the command line's documentation from its parser: docs/reference/cli.md (every command, every argument, its
default and its help) and the command table of docs/guides/cli.md, so neither can drift from what ``--help`` says.

    python tools/cli_reference.py

rewrites both; tests/unit/test_cli_reference.py fails, naming this command, when either differs from the parser.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lora_sampler, not an installed one

from lora_sampler.cli._main import build_parser  # noqa: E402  (after the path)
from lora_sampler.cli._parser import CommandParser  # noqa: E402

REFERENCE = ROOT / "docs" / "reference" / "cli.md"
GUIDE = ROOT / "docs" / "guides" / "cli.md"
#: The guide's command table, between its two markers.
GUIDE_TABLE = re.compile(r"(<!-- command table: .*? -->\n)(?P<table>.*?)(\n<!-- end of the command table -->)", re.S)
INTRO = """# Command-line reference

<!-- generated from the parser by tools/cli_reference.py: edit the parser's help, then run it -->

Every command of `lora-sampler` with every argument it takes, its default and its help, as the parser itself has
them (`lora-sampler COMMAND --help` prints the same). Every command also takes `-h`/`--help`, and
`lora-sampler --version` prints the version. [The command line](../guides/cli.md) guide says how they work together.
A blank default is decided at run time, as the help says.
"""


#: The ``nargs`` of a positional argument that may be left out (argparse's ``required`` of one differs by version).
_OPTIONAL_POSITIONAL = (argparse.OPTIONAL, argparse.ZERO_OR_MORE, argparse.REMAINDER)


def command_table(parser: CommandParser) -> str:
    """The subcommands as a Markdown table (the CLI guide's, checked by a test so it cannot drift)."""
    rows = ["| command | what it does |", "| --- | --- |"]
    for name, command in parser.commands.choices.items():
        rows.append(f"| `{parser.prog} {name}` | {command.description} |")
    return "\n".join(rows)


def flag_table(parser: CommandParser) -> str:
    """Every argument but ``--help`` as a Markdown table: how it is written, its default, its help (the command line
    reference's, checked by a test so it cannot drift)."""
    rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
    for action in sorted(parser.arguments, key=lambda action: bool(action.option_strings)):  # positionals first
        if action.dest != "help":
            cells = (f"`{_spelling(action)}`", _default_of(parser, action), action.help or "")
            rows.append("| " + " | ".join(_table_cell(cell) for cell in cells) + " |")
    return "\n".join(rows)


def _default_of(parser: CommandParser, action: argparse.Action) -> str:
    """``action``'s default as the reference shows it: required, a switch's off, a value, or one of a group."""
    for required, group in parser.exclusive:
        if action in group:
            others = ", ".join(f"`{other.option_strings[-1]}`" for other in group if other is not action)
            return f"required, or {others}" if required else f"not with {others}"
    if action.required if action.option_strings else action.nargs not in _OPTIONAL_POSITIONAL:
        return "required"
    if action.nargs == 0:
        return "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
    return f"`{' '.join(str(value) for value in values)}`"


def _table_cell(text: str) -> str:
    """``text`` as one Markdown table cell: on one line, its pipes escaped, and no ``<name>`` taken for an HTML tag."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _spelling(action: argparse.Action) -> str:
    """How ``action`` is written on the command line, as argparse's help shows it: ``-i, --input INPUT``,
    ``--checkpoints PATTERN [PATTERN ...]``, ``--format {auto,prompts}``, ``checkpoint``."""
    if not action.option_strings:
        return str(action.metavar or action.dest) + (" ..." if action.nargs == argparse.REMAINDER else "")
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.metavar is not None:
        value = str(action.metavar)
    elif action.choices is not None:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = action.dest.upper()
    return f"{flags} {value} [{value} ...]" if action.nargs == "+" else f"{flags} {value}"


def reference(parser: CommandParser) -> str:
    """The reference page: the command table, then each command's description, argument table and epilog."""
    parts = [INTRO, command_table(parser), "", str(parser.epilog), ""]
    for name, command in parser.commands.choices.items():
        parts += [f"## `{parser.prog} {name}`", "", command.description, "", flag_table(command), ""]
        if command.epilog:
            parts += [command.epilog.replace("<", "&lt;"), ""]  # DIR/<adapter>.jsonl is not an HTML tag
    return "\n".join(parts)


def expected() -> Dict[Path, str]:
    """Each generated file with the text it must hold."""
    parser = build_parser()
    assert isinstance(parser, CommandParser)
    guide = GUIDE.read_text(encoding="utf-8")
    table = command_table(parser)
    return {REFERENCE: reference(parser), GUIDE: GUIDE_TABLE.sub(lambda found: found[1] + table + found[3], guide)}


def main() -> int:
    """Rewrite every generated file that differs; print each one rewritten."""
    for path, text in expected().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
