"""The engine's token ids of the texts an evaluation asks about: each distinct text tokenized once, memory bounded.

lm-eval splits a context from its continuation by tokenizing both (and their join), and the same contexts come back
for every answer choice, every checkpoint of a sweep and every window of a long text. The tokenizer is the base
model's, so one answer holds for every adapter: the cache is shared by every checkpoint of a sweep. It holds at most
``max_size`` token ids plus text characters (least recently used out); a text pushed out is asked again.
"""

from __future__ import annotations

import collections
import threading
from typing import Iterable, Iterator, List, Optional, OrderedDict, Tuple

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook

#: The default bound: token ids plus text characters held (about 300 MB in the worst case, far less for most texts).
DEFAULT_MAX_SIZE = 8_000_000

_Key = Tuple[str, bool]


class TokenCache:
    """Token ids of texts by the engine's tokenizer (``SamplerClient.tokenize_many``), each distinct text asked once.

    Thread-safe. ``warm`` asks for many texts at once through the client's own fan-out (its workers, its retry table
    and, with ``max_outage``, its outage hold); ``encode`` answers from the cache, asking the engine for a text it
    does not hold.

    Args:
        client: The client whose engine tokenizes.
        max_size: Most token ids plus text characters held.
    """

    def __init__(self, client: SamplerClient, *, max_size: int = DEFAULT_MAX_SIZE):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be an int >= 1, got {max_size!r}")
        self._client, self._max_size = client, max_size
        self._entries: OrderedDict[_Key, Tuple[int, ...]] = collections.OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        #: ``/tokenize`` requests answered so far (each distinct text once while it stays cached).
        self.requests = 0

    def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool = False,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ) -> Tuple[int, ...]:
        """Return the token ids of ``text`` (from the cache, or asked now, held through an outage as ``warm``)."""
        key = (text, add_special_tokens)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        [tokens] = self._asked([text], add_special_tokens, max_outage, on_outage)
        return tokens

    def warm(
        self,
        texts: Iterable[str],
        *,
        add_special_tokens: bool = False,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ) -> None:
        """Tokenize every text not cached yet through the client's fan-out (each distinct text once).

        Args:
            texts: The texts.
            add_special_tokens: As for ``SamplerClient.tokenize``.
            max_outage: Seconds to wait out an engine outage (0: fail at once), as ``SamplerClient.imap``.
            on_outage: Called with an ``OutageEvent`` while the engine is away.

        Raises:
            EngineError: a tokenize request failed once the retry table (and the outage hold) ran its course; the
                answers taken before it are kept, the requests after it cancelled.
        """
        with self._lock:
            missing = [text for text in dict.fromkeys(texts) if (text, add_special_tokens) not in self._entries]
        for _ in self._asked(missing, add_special_tokens, max_outage, on_outage):
            pass

    def _asked(
        self, texts: List[str], special: bool, max_outage: float, on_outage: Optional[OutageHook]
    ) -> Iterator[Tuple[int, ...]]:
        """Ask the engine for ``texts`` (none: no request), keeping each answer as it comes."""
        if not texts:
            return
        answers = self._client.tokenize_many(
            texts, add_special_tokens=special, max_outage=max_outage, on_outage=on_outage
        )
        for text, tokens in zip(texts, answers):
            self._keep((text, special), tokens)
            yield tokens

    def _keep(self, key: _Key, tokens: Tuple[int, ...]) -> None:
        cost = len(key[0]) + len(tokens)
        with self._lock:
            self.requests += 1
            if key in self._entries or cost > self._max_size:
                return
            self._entries[key] = tokens
            self._size += cost
            while self._size > self._max_size:
                (text, _), dropped = self._entries.popitem(last=False)
                self._size -= len(text) + len(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def size(self) -> int:
        """Token ids plus text characters held now."""
        with self._lock:
            return self._size


def optional_cache(cache: Optional[TokenCache], client: SamplerClient) -> TokenCache:
    """``cache`` if given (a sweep shares one over its checkpoints), else a new one over ``client``."""
    return cache if cache is not None else TokenCache(client)
