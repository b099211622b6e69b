"""``CommandParser``: argparse with usage errors of one line that name the thing to change.

A mistyped flag gets a "did you mean" from the flags its command takes (``--num_samples`` is ``--num-samples``,
``-n`` is ``--num-samples``, ``--model`` is ``--adapter`` or ``--base-model``); a missing required flag is named in
one line with where the help is, never the whole usage. It raises ``UsageError``; ``main`` prints it and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, List, NoReturn, Optional, Sequence, Tuple

from lora_sampler.errors import LoraSamplerError

#: Flags other tools spell another way, and the flags of this command line that do the job.
FLAG_HABITS = {
    "-n": "--num-samples",
    "--n": "--num-samples",
    "--model": "--adapter (a LoRA checkpoint or adapter name) or --base-model (the engine's own model)",
    "--max-new-tokens": "--max-tokens",
    "--max-completion-tokens": "--max-tokens",
    "--url": "--base-url",
}


class UsageError(LoraSamplerError):
    """A flag combination or a path that cannot work; exit status 2."""


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises ``UsageError`` in one line, and knows the flags it takes (``flags``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        #: Every option string this parser takes, its parents' included (argparse copies theirs without
        #: ``add_argument``).
        self.flags: List[str] = [
            flag for parent in kwargs.get("parents", ()) if isinstance(parent, CommandParser) for flag in parent.flags
        ]
        #: The subcommands (what ``add_subparsers`` returned), for ``command_table``.
        self.commands: Any = None
        super().__init__(*args, **kwargs)

    def command_table(self) -> str:
        """The subcommands as a Markdown table (the CLI guide's, checked by a test so it cannot drift)."""
        rows = ["| command | what it does |", "| --- | --- |"]
        for name, command in self.commands.choices.items():
            rows.append(f"| `{self.prog} {name}` | {command.description} |")
        return "\n".join(rows)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Add an argument as argparse does, remembering its option strings."""
        action = super().add_argument(*args, **kwargs)
        self.flags.extend(action.option_strings)
        return action

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads; the same arguments
        self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
    ) -> Tuple[argparse.Namespace, List[str]]:
        """Parse as argparse does; a command's argument it does not take is a ``UsageError`` naming it."""
        parsed, extra = super().parse_known_args(args, namespace)
        if extra and self.flags:
            flags = [item for item in extra if item.startswith("-")]
            if flags:
                self.error(f"unknown flag {flags[0]}{self.suggestion(flags[0])}")
            self.error(f"unexpected argument {extra[0]!r}")
        return parsed, extra

    def suggestion(self, flag: str) -> str:
        """What ``flag`` is likely to mean among this parser's flags, as ``" (did you mean --x?)"``; "" when nothing."""
        name = flag.split("=", 1)[0]
        if name in FLAG_HABITS:
            return f" (use {FLAG_HABITS[name]})"
        spelled = name.replace("_", "-")
        close = [spelled] if spelled in self.flags else difflib.get_close_matches(spelled, self.flags, n=1)
        return f" (did you mean {close[0]}?)" if close else ""

    def error(self, message: str) -> NoReturn:
        """Raise the usage error in one line, saying where the help is (argparse prints the whole usage)."""
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")
