"""``lora-sampler adapters``: list the adapters published in the resolver folder, and remove old ones.

Listing reads the folder (each adapter's source checkpoint, size and age, from the marker publish writes). Removing
(``--older-than``) skips every adapter the engine has loaded and every one another run holds a lease on; what is
kept says why. No batch logic here.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import List

from lora_sampler._adapters.inventory import PublishedAdapter, describe_age, published_adapters
from lora_sampler._adapters.lease import leased, remove_if_unleased
from lora_sampler._client.client import SamplerClient
from lora_sampler.cli._terminal import aligned

#: Seconds per unit of ``--older-than``.
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def add_adapters_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``adapters``' own flags (the engine flags come from the shared parent parser)."""
    parser.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="AGE",
        help="remove the adapters published longer ago than AGE (e.g. 90m, 12h, 7d; plain numbers are seconds), "
        "except those the engine has loaded and those another run holds a lease on",
    )
    parser.add_argument("--dry-run", action="store_true", help="with --older-than: say what would go, remove nothing")


def parse_duration(text: str) -> float:
    """Parse ``--older-than``: a number with an optional unit s, m, h or d."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"takes an age such as 90m, 12h or 7d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def run_adapters(client: SamplerClient | None, lora_base_dir: str, older_than: float | None, dry_run: bool) -> int:
    """List the published adapters; with ``older_than``, remove those old enough that nothing uses. Return 0.

    Without a client (no ``--base-url``) the folder alone is listed and nothing is removed: only the engine can say
    which adapters it has loaded.
    """
    adapters = published_adapters(lora_base_dir)
    loaded = set() if client is None else set(client.loaded_adapters())
    now = time.time()
    print(_table(adapters, loaded, lora_base_dir, now))
    if client is None:
        print("(no --base-url: the engine was not asked which of these it has loaded)")
    if older_than is None or client is None:
        return 0
    removed: List[str] = []
    for adapter in adapters:
        if adapter.age(now) <= older_than:
            continue
        if adapter.name in loaded:
            print(f"kept {adapter.name}: loaded on the engine (unload it first: lora-sampler unload {adapter.name})")
        elif dry_run:
            print(f"would remove {adapter.name} ({adapter.describe(now)})")
        elif remove_if_unleased(lora_base_dir, adapter.name):
            removed.append(adapter.name)
            print(f"removed {adapter.name} ({adapter.describe(now)})")
        else:
            print(f"kept {adapter.name}: another run holds a lease on it (or this filesystem has no locks)")
    if not dry_run:
        print(f"{len(removed)} adapters removed, older than {describe_age(older_than)}")
    return 0


def _table(adapters: List[PublishedAdapter], loaded: set[str], lora_base_dir: str, now: float) -> str:
    rows = [["adapter", "size", "age", "state", "source"]]
    for adapter in adapters:
        in_use = leased(lora_base_dir, adapter.name)
        state = "loaded" if adapter.name in loaded else "leased" if in_use else "-"
        size = f"{adapter.size() / (1 << 20):.1f} MiB"
        rows.append([adapter.name, size, describe_age(adapter.age(now)), state, adapter.source or "-"])
    lines = [line.rstrip() for line in aligned(rows)]
    return "\n".join([*lines, f"{len(adapters)} adapters in {lora_base_dir}"])
