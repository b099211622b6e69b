"""The engine's token ids of the texts an evaluation asks about: each distinct text tokenized once, memory bounded.

lm-eval splits a context from its continuation by tokenizing both (and their join), and the same contexts come back
for every answer choice, every checkpoint of a sweep and every window of a long text. The tokenizer is the base
model's, so one answer holds for every adapter: the cache is shared by every checkpoint of a sweep. It holds at most
``max_size`` token ids plus text characters (least recently used out); a text pushed out is asked again.

With the base model's own tokenizer at hand (``tokenizer=``: its folder or ``tokenizer.json``, read with the
``tokenizers`` package, or a Hugging Face tokenizer object), texts are tokenized in-process instead: no ``/tokenize``
round trip, once the first text's ids are checked against the engine's (a tokenizer of another model is refused).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, OrderedDict, Tuple

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler.types import check_count

#: The default bound: token ids plus text characters held (about 300 MB in the worst case, far less for most texts).
DEFAULT_MAX_SIZE = 8_000_000

_Key = Tuple[str, bool]
#: Tokenizes texts in-process, without special tokens: the base model's own tokenizer (``local_tokenizer``).
LocalTokenizer = Callable[[List[str]], List[Tuple[int, ...]]]


class TokenCache:
    """Token ids of texts by the engine's tokenizer (``SamplerClient.tokenize_many``), each distinct text asked once.

    Thread-safe. ``warm`` asks for many texts at once through the client's own fan-out (its workers, its retry table
    and, with ``max_outage``, its outage hold); ``encode`` answers from the cache, asking the engine for a text it
    does not hold.

    Args:
        client: The client whose engine tokenizes.
        max_size: Most token ids plus text characters held.
        tokenizer: The base model's tokenizer, to tokenize in-process (see ``local_tokenizer``); the engine still
            answers once, for the first text, to prove it is the same tokenizer, and for ``add_special_tokens``.
    """

    def __init__(self, client: SamplerClient, *, max_size: int = DEFAULT_MAX_SIZE, tokenizer: Any = None):
        check_count("max_size", max_size, 1)
        self._client, self._max_size = client, max_size
        self._local = local_tokenizer(tokenizer) if tokenizer is not None else None
        self._local_checked = False
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
        """Tokenize ``texts`` (none: no request), in-process or by the engine, keeping each answer as it comes.

        The local tokenizer's first answer is checked against the engine's (one request), which must agree.
        """
        if not texts:
            return
        hold: Dict[str, Any] = {"max_outage": max_outage, "on_outage": on_outage}
        local = None if special else self._local
        if local is None:
            answers: Iterable[Tuple[int, ...]] = self._client.tokenize_many(texts, add_special_tokens=special, **hold)
        else:
            answers = local(texts)
            if not self._local_checked:
                self._check_local(texts[0], answers[0], hold)
        for text, tokens in zip(texts, answers):
            self._keep((text, special), tokens, local is None)
            yield tokens

    def _check_local(self, text: str, ids: Tuple[int, ...], hold: Dict[str, Any]) -> None:
        """Refuse a local tokenizer whose ids of ``text`` are not the engine's (asked once, counted in ``requests``)."""
        [engine] = self._client.tokenize_many([text], add_special_tokens=False, **hold)
        with self._lock:
            self.requests += 1
        if tuple(engine) != ids:
            raise ValueError(
                f"the tokenizer given (tokenizer=) is not the engine's: it makes {list(ids[:8])} of {text[:40]!r} "
                f"where the engine's makes {list(engine[:8])}; pass the served base model's own tokenizer (its "
                "folder or tokenizer.json), or leave tokenizer= out to ask the engine"
            )
        self._local_checked = True

    def _keep(self, key: _Key, tokens: Tuple[int, ...], asked: bool) -> None:
        cost = len(key[0]) + len(tokens)
        with self._lock:
            self.requests += asked
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


def local_tokenizer(tokenizer: Any) -> LocalTokenizer:
    """The base model's own tokenizer as a ``LocalTokenizer``: texts to token ids without special tokens.

    Args:
        tokenizer: The model's folder or its ``tokenizer.json`` (read with the ``tokenizers`` package, which the
            ``[lm-eval]`` extra installs), an object with a Hugging Face tokenizer's ``encode(text,
            add_special_tokens=False)``, or a ``LocalTokenizer`` this function made (returned as it is).

    Raises:
        ValueError: no ``tokenizer.json`` at the path, or one the ``tokenizers`` package cannot read.
        TypeError: neither a path nor an object with ``encode``.
        ImportError: a path without the ``tokenizers`` package.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        return _tokenizer_file(os.fspath(tokenizer))
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        read: LocalTokenizer = tokenizer  # this function's answer already: a sweep reads its file once
        return read
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer must be the base model's folder, its tokenizer.json, or a tokenizer with encode(); "
            f"got {type(tokenizer).__name__}"
        )
    return lambda texts: [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def _tokenizer_file(path: str) -> LocalTokenizer:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"tokenizer={path}: no tokenizer.json there; pass the base model's folder (with its tokenizer.json) or "
            "the file itself"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError(
            "tokenizer= reads tokenizer.json with the tokenizers package, which is not installed: "
            "pip install 'lora-sampler[lm-eval]' (or pip install tokenizers)"
        ) from error
    try:
        read = Tokenizer.from_file(file)
    except Exception as error:  # the package's own error for a file it cannot read (its type is not documented)
        raise ValueError(f"tokenizer={path}: the tokenizers package cannot read {file} ({error})") from error
    return lambda texts: [tuple(one.ids) for one in read.encode_batch(texts, add_special_tokens=False)]
