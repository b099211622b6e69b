"""Finding a bare adapter name before any completion: a folder in ``lora_base_dir``, or an adapter on the engine.

A name found in neither place while a published adapter carries it as its stem (``step-400`` beside the
content-named ``step-400-154de9a80e9f``) fails at once with ``AdapterNotFoundError`` naming that adapter, instead of
a retried 404 seconds later. Any other unknown name may still be arriving (another process publishing it, a shared
folder lagging), so it is sent and the retry table's race rows apply.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from typing import Any, List, Optional, Sequence

from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.routes import MODELS_PATH
from lora_sampler.errors import AdapterNotFoundError, EngineError
from lora_sampler.types import Adapter, model_cards

logger = logging.getLogger(__name__)

#: Suggestions named in the error at most.
MAX_SUGGESTIONS = 3
#: What publish appends to a checkpoint's stem: a dash and hex digits of the content digest.
_CONTENT_SUFFIX = re.compile(r"-[0-9a-f]{6,64}")


def find_adapter(name: str, lora_base_dir: str, transport: EngineTransport) -> Adapter:
    """Return the adapter a bare ``name`` means: its folder in ``lora_base_dir``, or the engine's adapter of that name.

    One ``GET /v1/models`` is sent when the folder is not there. An engine that does not answer it is left to the
    sample's own retries (the name is then taken as given).

    Raises:
        AdapterNotFoundError: neither ``lora_base_dir`` nor the engine has an adapter of that name, and a published
            adapter is named after it with a content digest (the name is that checkpoint's stem, not an adapter).
    """
    local = os.path.join(lora_base_dir, name)
    if os.path.isdir(local):
        return Adapter(name, local)
    try:
        on_engine = transport.get_json(MODELS_PATH, parse=_adapter_ids)
    except EngineError as exc:
        logger.debug("Could not list the engine's adapters to look for %r: %s", name, exc)
        return Adapter(name)
    if name in on_engine:
        return Adapter(name)
    published = sorted(set(local_adapter_names(lora_base_dir)) | set(on_engine))
    if not any(is_content_name_of(name, candidate) for candidate in published):
        return Adapter(name)  # may be arriving: the race rows of the retry table decide
    suggestions = closest_names(name, published)
    guess = f"; did you mean {' or '.join(map(repr, suggestions))}?" if suggestions else "."
    message = (
        f"adapter {name!r} is neither a folder in lora_base_dir {lora_base_dir} nor an adapter on the engine at "
        f"{transport.base_url}{guess} Publishing names an adapter after its checkpoint and content digest: pass the "
        "Adapter that publish() returns (or the name lora-sampler publish prints), or the checkpoint path itself"
    )
    raise AdapterNotFoundError(message, model=name, adapter=True, suggestions=suggestions)


def is_content_name_of(stem: str, candidate: str) -> bool:
    """Tell whether ``candidate`` is the content-derived name publish gives a checkpoint whose stem is ``stem``."""
    return _CONTENT_SUFFIX.fullmatch(candidate[len(stem) :]) is not None if candidate.startswith(stem) else False


def _adapter_ids(body: Any) -> List[str]:
    """Read the ids of the adapter cards (those with a ``parent``) from a ``GET /v1/models`` body."""
    return [str(card["id"]) for card in model_cards(body) if card.get("parent")]


def local_adapter_names(lora_base_dir: str) -> List[str]:
    """Return the adapter folders in ``lora_base_dir`` (hidden folders, such as publish temporaries, left out)."""
    try:
        entries = list(os.scandir(lora_base_dir))
    except OSError:
        return []
    return [entry.name for entry in entries if not entry.name.startswith(".") and entry.is_dir()]


def closest_names(name: str, candidates: Sequence[str], limit: int = MAX_SUGGESTIONS) -> List[str]:
    """Return up to ``limit`` candidates closest to ``name``, best first.

    A content-named adapter (``step-400-154de9a80e9f``) starts with the checkpoint's stem (``step-400``), so names
    that extend ``name`` come first (shortest first), then the closest by ``difflib`` similarity.
    """
    extended = sorted((c for c in candidates if c.startswith(name) and c != name), key=lambda c: (len(c), c))
    similar: Optional[List[str]] = difflib.get_close_matches(name, candidates, n=limit, cutoff=0.6)
    ordered = extended + [c for c in similar or () if c not in extended]
    return ordered[:limit]
