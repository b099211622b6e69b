"""Write the command line's documentation from its parser: docs/reference/cli.md (every command, every argument, its
default and its help) and the command table of docs/guides/cli.md, so neither can drift from what ``--help`` says.

    python tools/cli_reference.py

rewrites both; tests/unit/test_cli_reference.py fails, naming this command, when either differs from the parser.
"""

from __future__ import annotations

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


def reference(parser: CommandParser) -> str:
    """The reference page: the command table, then each command's description, argument table and epilog."""
    parts = [INTRO, parser.command_table(), "", str(parser.epilog), ""]
    for name, command in parser.commands.choices.items():
        parts += [f"## `{parser.prog} {name}`", "", command.description, "", command.flag_table(), ""]
        if command.epilog:
            parts += [command.epilog.replace("<", "&lt;"), ""]  # DIR/<adapter>.jsonl is not an HTML tag
    return "\n".join(parts)


def expected() -> Dict[Path, str]:
    """Each generated file with the text it must hold."""
    parser = build_parser()
    assert isinstance(parser, CommandParser)
    guide = GUIDE.read_text(encoding="utf-8")
    table = parser.command_table()
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
