"""The adapter-name rule, in one place (see docs/guides/publishing.md).

An adapter name is the ``model`` field of every request and one folder inside ``lora_base_dir``, so it must be
safe on the wire, in a path, and in a log line. The rule is exactly what the error message states:

- ASCII letters, digits, ``.``, ``_`` and ``-`` only (no separator, no control or invisible character);
- not starting with ``.`` (hidden; this covers ``.`` and ``..``, and lora_sampler's own ``.tmp-*`` folders);
- not ending in an archive suffix (``.tar.gz``, ``.tar.xz``, ``.tgz``, ...: ``sample(adapter=...)`` reads those as
  checkpoint paths);
- at most ``MAX_NAME_LENGTH`` characters.
"""

from __future__ import annotations

import re

from lora_sampler._wire.archives import archive_suffix_list, has_archive_suffix

__all__ = ["MAX_NAME_LENGTH", "NAME_RULE", "validate_adapter_name"]

#: Longest adapter name accepted (the folder name, and the ``model`` field of every request).
MAX_NAME_LENGTH = 200
#: The rule as users read it in every refusal.
NAME_RULE = (
    f"use 1 to {MAX_NAME_LENGTH} ASCII letters, digits, '.', '_' or '-', not starting with '.' and not ending in "
    f"{archive_suffix_list()} (e.g. 'step-400')"
)
_ALLOWED = re.compile(r"[A-Za-z0-9._-]+\Z")


def validate_adapter_name(name: object, *, argument: str = "name") -> str:
    """Return ``name`` if it follows the adapter-name rule, before any request or file access.

    Args:
        name: The proposed name.
        argument: The argument name to cite in the error.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: it breaks the rule; the message names the problem and states the whole rule.
    """
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str, got {type(name).__name__}")
    problem = _problem_of(name)
    if problem:
        # ascii(): a right-to-left override or a lone surrogate must not reorder or break the message itself.
        raise ValueError(f"{argument}={name!a} is not a valid adapter name: it {problem}; {NAME_RULE}")
    return name


def _problem_of(name: str) -> str:
    """Return the first part of the rule ``name`` breaks, as the refusal says it, or "" when it follows the rule."""
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"is longer than {MAX_NAME_LENGTH} characters"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    bad = next((char for char in name if not _ALLOWED.match(char)), "")
    if bad:
        return f"contains {bad!a} (U+{ord(bad):04X}), which is not an ASCII letter, digit, '.', '_' or '-'"
    if name.startswith("."):
        return "starts with a dot"
    if has_archive_suffix(name):
        return "ends like an archive, so sample(adapter=...) would read it as a checkpoint path"
    return ""
