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


class UsageError(LoraSamplerError, ValueError):
    """A flag combination, a flag's value or a path that cannot work; exit status 2."""


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises ``UsageError`` in one line, and knows the flags it takes (``flags``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        #: Every argument this parser takes, in the order they were added, a mutually exclusive group's included.
        self.arguments: List[argparse.Action] = []
        #: The mutually exclusive groups among ``arguments``: whether one is required, and its arguments (the
        #: reference's defaults, ``tools/cli_reference.py``).
        self.exclusive: List[Tuple[bool, List[argparse.Action]]] = []
        #: The subcommands (what ``add_subparsers`` returned), for the reference (``tools/cli_reference.py``).
        self.commands: Any = None
        super().__init__(*args, **kwargs)

    @property
    def flags(self) -> List[str]:
        """Every option string this parser takes (its groups' included), for the "did you mean"."""
        return [flag for action in self.arguments for flag in action.option_strings]

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
