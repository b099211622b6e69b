"""What the resolver folder holds: each published adapter's name, source checkpoint, size and age.

Read from the folders and the marker publish writes into each (``.lora_sampler.json``: digest and source). Used to
tell look-alike names apart in a "did you mean" and by ``lora-sampler adapters``. No HTTP; nothing is changed here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import List, Optional

from lora_sampler._adapters.archive import CONFIG_FILE, MARKER_FILE
from lora_sampler._adapters.publish import read_marker


@dataclass(frozen=True)
class PublishedAdapter:
    """One adapter folder in the resolver folder.

    Attributes:
        name: The folder's (and the adapter's) name.
        path: The folder.
        source: The checkpoint it was published from (path or URL), when lora_sampler published it.
        digest: The checkpoint's content digest, when lora_sampler published it.
        published: When it was published (epoch seconds): the marker's time, else the folder's.
    """

    name: str
    path: str
    source: Optional[str]
    digest: Optional[str]
    published: float

    def age(self, now: Optional[float] = None) -> float:
        """Seconds since it was published."""
        return max(0.0, (time.time() if now is None else now) - self.published)

    def describe(self, now: Optional[float] = None) -> str:
        """Say where it comes from and how old it is: ``from runs/exp1/step-400.tar.gz, published 3 min ago``."""
        origin = f"from {self.source}" if self.source else "not published by lora_sampler"
        return f"{origin}, published {describe_age(self.age(now))} ago"

    def size(self) -> int:
        """Bytes of its files (read now, walking the folder; links are not followed)."""
        total = 0
        for folder, _, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    continue  # removed while it was walked
        return total


def describe_age(seconds: float) -> str:
    """Say an age the way a person reads it: ``12 s``, ``3 min``, ``5 h``, ``2 days``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def read_published(lora_base_dir: str, name: str) -> Optional[PublishedAdapter]:
    """Return the adapter folder ``name`` in ``lora_base_dir``, or None when there is no such folder."""
    path = os.path.join(lora_base_dir, name)
    try:
        folder_time = os.stat(path).st_mtime
    except OSError:
        return None
    if not os.path.isdir(path):
        return None
    marker = read_marker(path)
    try:
        published = os.stat(os.path.join(path, MARKER_FILE)).st_mtime
    except OSError:
        published = folder_time
    source, digest = marker.get("source"), marker.get("digest")
    return PublishedAdapter(
        name,
        path,
        source if isinstance(source, str) else None,
        digest if isinstance(digest, str) else None,
        published,
    )


def local_adapter_names(lora_base_dir: str) -> List[str]:
    """Return the adapter folders in ``lora_base_dir`` (hidden folders, such as publish temporaries, left out)."""
    try:
        entries = list(os.scandir(lora_base_dir))
    except OSError:
        return []
    return [entry.name for entry in entries if not entry.name.startswith(".") and entry.is_dir()]


def published_adapters(lora_base_dir: str) -> List[PublishedAdapter]:
    """Return every adapter folder of ``lora_base_dir``, oldest first (hidden folders such as leases left out).

    A folder counts when it holds ``adapter_config.json`` or lora_sampler's marker.
    """
    found = []
    for name in local_adapter_names(lora_base_dir):
        adapter = read_published(lora_base_dir, name)
        if adapter is not None and (
            os.path.isfile(os.path.join(adapter.path, CONFIG_FILE)) or adapter.digest is not None
        ):
            found.append(adapter)
    return sorted(found, key=lambda adapter: (adapter.published, adapter.name))
