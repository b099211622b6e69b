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

#: The ``nargs`` of a positional argument that may be left out (argparse's ``required`` of one differs by version).
_OPTIONAL_POSITIONAL = (argparse.OPTIONAL, argparse.ZERO_OR_MORE, argparse.REMAINDER)


class UsageError(LoraSamplerError):
    """A flag combination or a path that cannot work; exit status 2."""


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises ``UsageError`` in one line, and knows the flags it takes (``flags``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        #: Every argument this parser takes, in the order they were added: its parents' first (argparse copies
        #: theirs without ``add_argument``), then its own, a mutually exclusive group's included.
        self.arguments: List[argparse.Action] = [
            action
            for parent in kwargs.get("parents", ())
            if isinstance(parent, CommandParser)
            for action in parent.arguments
        ]
        #: The mutually exclusive groups among ``arguments``: whether one is required, and its arguments.
        self.exclusive: List[Tuple[bool, List[argparse.Action]]] = [
            group
            for parent in kwargs.get("parents", ())
            if isinstance(parent, CommandParser)
            for group in parent.exclusive
        ]
        #: The subcommands (what ``add_subparsers`` returned), for ``command_table``.
        self.commands: Any = None
        super().__init__(*args, **kwargs)

    @property
    def flags(self) -> List[str]:
        """Every option string this parser takes (its parents' and its groups' included), for the "did you mean"."""
        return [flag for action in self.arguments for flag in action.option_strings]

    def command_table(self) -> str:
        """The subcommands as a Markdown table (the CLI guide's, checked by a test so it cannot drift)."""
        rows = ["| command | what it does |", "| --- | --- |"]
        for name, command in self.commands.choices.items():
            rows.append(f"| `{self.prog} {name}` | {command.description} |")
        return "\n".join(rows)

    def flag_table(self) -> str:
        """Every argument but ``--help`` as a Markdown table: how it is written, its default, its help (the command
        line reference's, checked by a test so it cannot drift)."""
        rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
        for action in sorted(self.arguments, key=lambda action: bool(action.option_strings)):  # positionals first
            if action.dest != "help":
                cells = (f"`{_spelling(action)}`", self._default_of(action), action.help or "")
                rows.append("| " + " | ".join(_table_cell(cell) for cell in cells) + " |")
        return "\n".join(rows)

    def _default_of(self, action: argparse.Action) -> str:
        """``action``'s default as the reference shows it: required, a switch's off, a value, or one of a group."""
        for required, group in self.exclusive:
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

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Add an argument as argparse does, remembering it."""
        action = super().add_argument(*args, **kwargs)
        self.arguments.append(action)
        return action

    def add_mutually_exclusive_group(self, *, required: bool = False) -> ExclusiveGroup:  # type: ignore[override]
        """A mutually exclusive group whose arguments this parser remembers (argparse adds them behind its
        ``add_argument``, so they would be missing from ``flags`` and the reference)."""
        group = ExclusiveGroup(super().add_mutually_exclusive_group(required=required), self.arguments)
        self.exclusive.append((required, group.arguments))
        return group

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


class ExclusiveGroup:
    """argparse's mutually exclusive group, whose ``add_argument`` also adds to the parser's ``arguments``."""

    def __init__(self, group: Any, parser_arguments: List[argparse.Action]):
        self._group = group
        self._parser_arguments = parser_arguments
        #: This group's arguments, in the order they were added.
        self.arguments: List[argparse.Action] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Add an argument to the group as argparse does, remembering it here and in the parser."""
        action: argparse.Action = self._group.add_argument(*args, **kwargs)
        self.arguments.append(action)
        self._parser_arguments.append(action)
        return action


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
