"""The checkpoint archive suffixes, written once: what marks an ``adapter=`` string as an archive path.

``types.is_checkpoint_path`` reads an ``adapter=`` value ending in one as a checkpoint, the adapter-name rule
refuses names ending in one, and a default adapter name drops it from the file name. Pure names: no I/O.
"""

from __future__ import annotations

from typing import Tuple

#: Archive suffixes publish reads (gzip, bzip2, xz and plain tar), longest first so stripping takes the whole one.
ARCHIVE_SUFFIXES: Tuple[str, ...] = (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tbz2", ".txz", ".tar")


def has_archive_suffix(name: str) -> bool:
    """Tell whether ``name`` ends in an archive suffix, in any letter case."""
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def strip_archive_suffix(name: str) -> str:
    """Return ``name`` without its archive suffix (any letter case), or unchanged when it has none."""
    lowered = name.lower()
    return next((name[: -len(suffix)] for suffix in ARCHIVE_SUFFIXES if lowered.endswith(suffix)), name)


def archive_suffix_list() -> str:
    """Return the suffixes as a reader sees them in a message: ``'.tar.gz', '.tar.bz2', ... or '.tar'``."""
    quoted = [f"'{suffix}'" for suffix in ARCHIVE_SUFFIXES]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]
