"""Finding a bare adapter name before any completion: a folder in ``lora_base_dir``, or an adapter on the engine.

A name found in neither place that looks like a slip of a published adapter's name fails at once with
``AdapterNotFoundError`` naming the look-alikes, each with its source checkpoint and age, instead of a retried 404
seconds later. A slip is the checkpoint's stem of a content name (``step-400`` beside ``step-400-154de9a80e9f``),
that stem mistyped (``step-40``, ``stpe-400``), or the content name with its digest mistyped or cut short. Any other
unknown name may still be arriving (another process publishing it, a shared folder lagging), so it is sent and the
retry table's race rows apply: a new checkpoint's digest differs from the old one's in nearly every character.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import time
from typing import Any, List, Optional, Sequence

from lora_sampler._adapters.inventory import local_adapter_names, read_published
from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.answers import model_cards
from lora_sampler._wire.routes import MODELS_PATH
from lora_sampler.errors import AdapterNotFoundError, EngineError
from lora_sampler.types import Adapter

logger = logging.getLogger(__name__)

#: Suggestions named in the error at most.
MAX_SUGGESTIONS = 3
#: Wrong characters a name may hold and still be taken for a slip of a published name.
MAX_TYPOS = 2
#: A content name: the checkpoint's stem, a dash, the hex digits of its content digest.
_CONTENT_NAME = re.compile(r"(.+)-([0-9a-f]{6,64})")
#: Digest characters a name cut short must still hold to be taken for a slip (``step-400-1`` is not one).
_MIN_DIGEST_TYPED = 4


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
        on_engine = transport.get_json(MODELS_PATH, parse=adapter_ids)
    except EngineError as exc:
        logger.debug("Could not list the engine's adapters to look for %r: %s", name, exc)
        return Adapter(name)
    if name in on_engine:
        return Adapter(name)
    published = sorted(set(local_adapter_names(lora_base_dir)) | set(on_engine))
    look_alikes = [candidate for candidate in published if is_slip_of(name, candidate)]
    if not look_alikes:
        return Adapter(name)  # may be arriving: the race rows of the retry table decide
    suggestions = closest_names(name, look_alikes, cutoff=0.0)  # each is a look-alike: order them only
    message = (
        f"adapter {name!r} is neither a folder in lora_base_dir {lora_base_dir} nor an adapter on the engine at "
        f"{transport.base_url}; did you mean {_described(suggestions, lora_base_dir)}? Publishing names an adapter "
        "after its checkpoint and content digest: pass the Adapter that publish() returns (or the name lora-sampler "
        "publish prints), or the checkpoint path itself"
    )
    raise AdapterNotFoundError(message, model=name, adapter=True, suggestions=suggestions)


def _described(names: Sequence[str], lora_base_dir: str) -> str:
    """The suggestions, each with where it comes from and its age, so look-alikes can be told apart."""
    now = time.time()
    parts = []
    for name in names:
        folder = read_published(lora_base_dir, name)
        parts.append(f"{name!r} ({folder.describe(now) if folder is not None else 'loaded on the engine'})")
    return " or ".join(parts)


def is_slip_of(name: str, candidate: str) -> bool:
    """Tell whether ``name`` is a slip of the content-named ``candidate`` (``<stem>-<hex digest>``).

    A slip: the stem itself, the stem with up to ``MAX_TYPOS`` characters wrong, or the candidate with its digest
    cut short or up to ``MAX_TYPOS`` characters wrong. Another checkpoint's name (a new digest, another step with
    its own digest) is not one.
    """
    match = _CONTENT_NAME.fullmatch(candidate)
    if match is None or name == candidate:
        return False
    stem, digest = match.group(1), match.group(2)
    if name.startswith(stem + "-"):
        typed = name[len(stem) + 1 :]
        return (len(typed) >= _MIN_DIGEST_TYPED and digest.startswith(typed)) or _within(typed, digest, MAX_TYPOS)
    if _CONTENT_NAME.fullmatch(name) is not None:
        return False  # another content name: another checkpoint, perhaps still arriving
    return name == stem or (len(stem) > MAX_TYPOS * 2 and _within(name, stem, MAX_TYPOS))


def _within(a: str, b: str, limit: int) -> bool:
    """Tell whether ``a`` and ``b`` are at most ``limit`` edits apart (Levenshtein, cut off past the limit)."""
    if abs(len(a) - len(b)) > limit:
        return False
    previous = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char != other)))
        if min(current) > limit:
            return False
        previous = current
    return previous[-1] <= limit


def adapter_ids(body: Any) -> List[str]:
    """Read the ids of the adapter cards (those with a ``parent``) from a ``GET /v1/models`` body."""
    return [str(card["id"]) for card in model_cards(body) if card.get("parent")]


def closest_names(name: str, candidates: Sequence[str], limit: int = MAX_SUGGESTIONS, cutoff: float = 0.6) -> List[str]:
    """Return up to ``limit`` candidates closest to ``name``, best first.

    A content-named adapter (``step-400-154de9a80e9f``) starts with the checkpoint's stem (``step-400``), so names
    that extend ``name`` come first (shortest first), then the closest by ``difflib`` similarity, down to ``cutoff``
    (0 keeps every candidate: it only orders them).
    """
    extended = sorted((c for c in candidates if c.startswith(name) and c != name), key=lambda c: (len(c), c))
    similar: Optional[List[str]] = difflib.get_close_matches(name, candidates, n=limit, cutoff=cutoff)
    ordered = extended + [c for c in similar or () if c not in extended]
    return ordered[:limit]
