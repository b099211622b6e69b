"""FakeEngine's vocabulary (``encode_text``, ``decode_token``) and ``ByteTokenizer``, its tokenizer for tests that need
one without the Hugging Face Hub.

FakeEngine tokenizes text one UTF-8 byte per token (byte ``b`` is id ``4 + b``) after four specials; ids above the
bytes exist in its vocabulary but stand for no text. This class is that tokenizer with the methods Tinker code and
tinker-cookbook's renderers call on a Hugging Face tokenizer (``encode``, ``decode``, the special tokens, the
vocabulary, ``apply_chat_template``), so the same code runs against FakeEngine with no model download. Stdlib only.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from lora_sampler.testing._chat import render_chat

#: Ids 0-3 are the tiny tokenizer's specials; byte ``b`` of UTF-8 text is id ``4 + b``.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
#: FakeEngine's default ``vocab_size``.
DEFAULT_VOCAB_SIZE = 1024


def encode_text(text: str) -> list[int]:
    """Tokenize ``text`` the fake's way: each UTF-8 byte ``b`` becomes token id ``4 + b`` (no BOS)."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def decode_token(token_id: int) -> str:
    """Return the text of one token: a special, a printable byte, ``<0xHH>``, or `` t<id>`` above the bytes."""
    if token_id < BYTE_OFFSET:
        return SPECIAL_TOKENS[token_id]
    byte = token_id - BYTE_OFFSET
    if byte < 256:
        return chr(byte) if 32 <= byte < 127 else f"<0x{byte:02X}>"
    return f" t{token_id}"


class ByteTokenizer:
    """FakeEngine's tokenizer: ids 0-3 are ``<unk> <s> </s> <pad>``, byte ``b`` of UTF-8 text is ``4 + b``.

    ``encode`` never adds a BOS (FakeEngine adds none either); ``decode`` joins byte tokens back into UTF-8 text
    (an invalid sequence becomes U+FFFD) and shows an id above the bytes as `` t<id>``, as FakeEngine does. Pass
    it where a Hugging Face tokenizer is expected: ``lora_sampler.tinker.ServiceClient(..., tokenizer=...)``, a
    cookbook renderer.

    Args:
        vocab_size: The engine's ``vocab_size`` (FakeEngine's default, 1024); ids from it up are refused.
    """

    unk_token, bos_token, eos_token, pad_token = SPECIAL_TOKENS
    unk_token_id, bos_token_id, eos_token_id, pad_token_id = range(BYTE_OFFSET)
    name_or_path = "lora_sampler.testing.ByteTokenizer"

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < BYTE_OFFSET + 256:
            raise ValueError(
                f"vocab_size must be an int >= {BYTE_OFFSET + 256} (the specials and bytes), got {vocab_size!r}"
            )
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def __len__(self) -> int:
        return self.vocab_size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer) and other.vocab_size == self.vocab_size

    def __hash__(self) -> int:
        return hash((ByteTokenizer, self.vocab_size))

    @property
    def all_special_ids(self) -> list[int]:
        """The special token ids (0-3)."""
        return list(range(BYTE_OFFSET))

    def encode(self, text: str, add_special_tokens: bool = True, **_options: Any) -> list[int]:
        """Return the token ids of ``text`` (one per UTF-8 byte; no BOS, whatever ``add_special_tokens`` says)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return encode_text(text)

    def __call__(self, text: str, add_special_tokens: bool = True, **options: Any) -> dict[str, list[int]]:
        """Return ``{"input_ids": ..., "attention_mask": ...}`` as a Hugging Face tokenizer does for one text."""
        ids = self.encode(text, add_special_tokens, **options)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: Iterable[int] | int, skip_special_tokens: bool = False, **_options: Any) -> str:
        """Return the text of ``token_ids``: UTF-8 byte runs, specials by name (unless skipped), others as the fake."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        parts: list[str] = []
        run = bytearray()
        for token in map(self._checked, ids):
            if BYTE_OFFSET <= token < BYTE_OFFSET + 256:
                run.append(token - BYTE_OFFSET)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if token >= BYTE_OFFSET + 256 or not skip_special_tokens:
                parts.append(decode_token(token))
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        """``decode`` each sequence."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: Sequence[int] | int) -> list[str] | str:
        """Return each id's token string: a special's name, ``<0xHH>`` for a byte, `` t<id>`` above the bytes."""
        if isinstance(ids, int):
            return self._token(self._checked(ids))
        return [self._token(self._checked(token)) for token in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str] | str) -> list[int] | int:
        """The inverse of ``convert_ids_to_tokens`` (an unknown string is ``<unk>``, 0)."""
        vocabulary = self.get_vocab()
        if isinstance(tokens, str):
            return vocabulary.get(tokens, self.unk_token_id)
        return [vocabulary.get(token, self.unk_token_id) for token in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Every token string and its id."""
        return {self._token(token): token for token in range(self.vocab_size)}

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_options: Any,
    ) -> list[int] | str:
        """Render ``conversation`` with FakeEngine's chat template (``lora_sampler.testing.CHAT_TEMPLATE``)."""
        text = render_chat([dict(message) for message in conversation], add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text

    def _checked(self, token: object) -> int:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token!r} is not in the vocabulary (0..{self.vocab_size - 1})")
        return token

    @staticmethod
    def _token(token: int) -> str:
        return f"<0x{token - BYTE_OFFSET:02X}>" if BYTE_OFFSET <= token < BYTE_OFFSET + 256 else decode_token(token)
