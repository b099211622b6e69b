"""``lora_sampler.testing.ByteTokenizer``: FakeEngine's vocabulary as a tokenizer, and the [tinker] extra stays out of
``import lora_sampler``."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_sampler.testing import ByteTokenizer, decode_token, encode_text, render_chat


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_encode_is_the_engines_tokenization_and_decode_inverts_it(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == encode_text(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer(text)["input_ids"] == ids


def test_special_and_high_ids_decode_as_the_engine_names_them() -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    assert tokenizer.decode([1, *encode_text("hi"), 2]) == "<s>hi</s>"
    assert tokenizer.decode([1, *encode_text("hi"), 2], skip_special_tokens=True) == "hi"
    assert tokenizer.decode([700]) == decode_token(700) == " t700"
    assert tokenizer.decode(encode_text("é")[:1]) == "\ufffd"  # half a UTF-8 character
    assert tokenizer.convert_ids_to_tokens([0, 4 + ord("A"), 900]) == ["<unk>", "<0x41>", " t900"]
    assert tokenizer.convert_tokens_to_ids(["<0x41>", "nope"]) == [4 + ord("A"), 0]
    assert len(tokenizer.get_vocab()) == len(tokenizer) == 1024


@pytest.mark.parametrize("bad", [-1, 1024, 10**9, 1.5, True, None])
def test_ids_outside_the_vocabulary_are_refused_by_value(bad: object) -> None:
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ByteTokenizer().decode([5, bad])  # type: ignore[list-item]


def test_vocab_size_follows_the_engine_and_is_checked() -> None:
    assert ByteTokenizer(2048).decode([2000]) == " t2000"
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100)


def test_chat_template_is_the_engines() -> None:
    messages = [{"role": "user", "content": "2+2?"}]
    tokenizer = ByteTokenizer()
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render_chat(messages)
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert isinstance(without, str) and render_chat(messages).startswith(without) and not without.endswith("|>\n")
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == encode_text(render_chat(messages))


def test_it_pickles_and_compares_by_vocabulary() -> None:
    assert pickle.loads(pickle.dumps(ByteTokenizer(2048))) == ByteTokenizer(2048) != ByteTokenizer()


def test_import_lora_sampler_loads_no_extra() -> None:
    code = (
        "import sys, lora_sampler, lora_sampler.batch, lora_sampler.testing, lora_sampler.cli; "
        "loaded = sorted(m for m in ('tinker', 'numpy', 'transformers', 'lora_sampler.tinker') if m in sys.modules); "
        "print(loaded)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_lora_sampler_tinker_names_the_extra_when_tinker_is_missing() -> None:
    code = "import sys; sys.modules['tinker'] = None; import lora_sampler.tinker"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    if sys.version_info >= (3, 11):
        assert "pip install 'lora_sampler[tinker]'" in result.stderr
    else:  # tinker 0.38 needs 3.11: the extra installs nothing here, and the message says why
        assert "needs Python >= 3.11" in result.stderr
