"""The engine's tokenizer as public client API, on loopback: ``tokenize``, ``max_model_len``, ``render_chat``.

What a harness needs from the engine (the context/continuation split, context windows, chat prompts), without a
tokenizer download: the answers are FakeEngine's (one token per UTF-8 byte, ids 4 + byte; no BOS) and its fixed chat
template, and each request rides the retry table.
"""

from __future__ import annotations

import itertools
from typing import List

import pytest

from lora_sampler import EngineConnectionError, EngineStatusError, OutageEvent, RetryPolicy, SamplerClient
from lora_sampler._wire.routes import DETOKENIZE_PATH, TOKENIZE_PATH
from lora_sampler.testing import CHAT_TEMPLATE, ByteTokenizer, FakeEngine

FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi é"}]


def test_tokenize_is_the_engines_tokenizer(engine: FakeEngine) -> None:
    """Token ids of text are those of the engine's tokenizer (the fake's: one per UTF-8 byte), one request each."""
    with SamplerClient(engine.url) as client:
        tokens = client.tokenize("Hé!")
        piece = client.tokenize(" world", add_special_tokens=False)
    assert tokens == tuple(ByteTokenizer().encode("Hé!")) == (4 + 72, 4 + 0xC3, 4 + 0xA9, 4 + 33)
    assert piece == tuple(4 + b for b in b" world")
    assert engine.calls(TOKENIZE_PATH) == 2


def test_tokenize_sends_add_special_tokens_as_asked(engine: FakeEngine) -> None:
    """``add_special_tokens`` reaches the engine (True by default, as vLLM tokenizes a text prompt)."""
    with SamplerClient(engine.url) as client:
        client.tokenize("a")
        client.tokenize("a", add_special_tokens=False)
    records = [record for record in engine.requests if record.path == TOKENIZE_PATH]
    assert [dict(record.extra_fields)["add_special_tokens"] for record in records] == [True, False]
    assert {record.model for record in records} == {engine.model}


def test_tokenize_rides_the_retry_table(engine: FakeEngine) -> None:
    """Two dropped connections on ``/tokenize`` are retried; the third attempt answers."""
    engine.inject_fault("drop", path=TOKENIZE_PATH, count=2)
    with SamplerClient(engine.url, retry=FAST) as client:
        assert client.tokenize("ok") == (4 + 111, 4 + 107)
    assert engine.calls(TOKENIZE_PATH) == 3


def test_tokenize_refuses_what_is_not_text(engine: FakeEngine) -> None:
    """Token ids or bytes are a TypeError naming the type, before any request."""
    with SamplerClient(engine.url) as client:
        with pytest.raises(TypeError, match="text must be a str, got bytes"):
            client.tokenize(b"abc")  # type: ignore[arg-type]
    assert engine.calls(TOKENIZE_PATH) == 0


def test_tokenize_many_answers_in_input_order_through_the_pool(engine: FakeEngine) -> None:
    """Each text's ids in input order, as ``tokenize`` gives them, from a generator pulled as answers come."""
    texts = [f"text {i}" * (i % 4 + 1) for i in range(40)]
    with SamplerClient(engine.url, max_workers=4) as client:
        answers = list(client.tokenize_many(text for text in texts))
        singles = [client.tokenize(text) for text in texts[:3]]
        pieces = list(client.tokenize_many(["é"], add_special_tokens=False))
    assert answers == [tuple(ByteTokenizer().encode(text)) for text in texts] and answers[:3] == singles
    assert pieces == [(4 + 0xC3, 4 + 0xA9)]
    assert engine.calls(TOKENIZE_PATH) == 44


def test_tokenize_many_pulls_an_endless_generator_as_the_answers_come(engine: FakeEngine) -> None:
    """A generator without end is read a bounded window ahead; closing the iteration sends no more."""
    with SamplerClient(engine.url, max_workers=2) as client:
        answers = client.tokenize_many(f"text {n}" for n in itertools.count())
        taken = [next(answers) for _ in range(5)]
        answers.close()  # type: ignore[attr-defined]
        asked = engine.calls(TOKENIZE_PATH)
        assert client.tokenize("after") == tuple(4 + b for b in b"after")
    assert taken == [tuple(4 + b for b in f"text {n}".encode()) for n in range(5)]
    assert 5 <= asked <= 5 + 2 * 2 + 1  # the answers taken, and at most the window read ahead (2 per worker)


def test_tokenize_many_refuses_a_text_that_is_not_one_in_its_slot(engine: FakeEngine) -> None:
    """A non-str item raises when the iteration reaches it, naming its type; it is never sent."""
    with SamplerClient(engine.url) as client:
        answers = client.tokenize_many(["a", b"b", "c"])  # type: ignore[list-item]
        assert next(answers) == (4 + 97,)
        with pytest.raises(TypeError, match="texts must hold str values, got bytes"):
            next(answers)
    assert engine.calls(TOKENIZE_PATH) <= 2  # "a", and perhaps "c" read ahead; never b"b"


def test_tokenize_many_waits_out_an_outage_and_says_so(engine: FakeEngine) -> None:
    """With ``max_outage``, a /tokenize that fails outage-class is held, the engine probed, the text asked again."""
    events: List[OutageEvent] = []
    engine.inject_fault("drop", path=TOKENIZE_PATH, count=2)
    with SamplerClient(engine.url, retry=RetryPolicy(max_attempts=1), max_workers=1) as client:
        with pytest.raises(EngineConnectionError):
            list(client.tokenize_many(["x"]))  # no hold by default: the first failure raises
        answers = list(client.tokenize_many(["x", "y"], max_outage=60, on_outage=events.append))
    assert answers == [(4 + 120,), (4 + 121,)]
    assert [event.kind for event in events if event.kind != "waiting"] == ["held", "back"]


def test_max_model_len_is_the_served_context(make_engine: object) -> None:
    """``max_model_len`` is the base card's (read once, cached)."""
    engine = make_engine(max_model_len=333)  # type: ignore[operator]
    with SamplerClient(engine.url) as client:
        assert client.max_model_len() == 333
        assert client.max_model_len() == 333
    assert engine.calls("/v1/models") == 1


def test_render_chat_is_the_engines_template(engine: FakeEngine) -> None:
    """The rendered prompt is the engine template's text; chat's prompt tokens are exactly its tokens."""
    with SamplerClient(engine.url) as client:
        text = client.render_chat(MESSAGES)
        reply = client.chat(MESSAGES, base_model=engine.model, max_tokens=1)
        tokens = client.tokenize(text, add_special_tokens=False)
    assert text == "<|system|>\nBe terse.\n<|user|>\nHi é\n<|assistant|>\n"
    assert text == ByteTokenizer().apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(tokens)
    assert "<|assistant|>" in CHAT_TEMPLATE
    assert engine.calls(TOKENIZE_PATH) == 2 and engine.calls(DETOKENIZE_PATH) == 1


def test_render_chat_without_generation_prompt_or_continuing(engine: FakeEngine) -> None:
    """Without the generation prompt the text ends after the last message; continuing, inside it."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    with SamplerClient(engine.url) as client:
        closed = client.render_chat(MESSAGES, add_generation_prompt=False)
        continued = client.render_chat(prefill, add_generation_prompt=False, continue_final_message=True)
        with pytest.raises(ValueError, match="exclusive"):
            client.render_chat(prefill, continue_final_message=True)
    assert closed == "<|system|>\nBe terse.\n<|user|>\nHi é\n"
    assert continued == closed + "<|assistant|>\nThe answer is"


def test_render_chat_checks_messages_before_any_request(engine: FakeEngine) -> None:
    """Bad messages are refused by the client, naming the message, with no request sent."""
    with SamplerClient(engine.url) as client:
        with pytest.raises(ValueError, match=r"messages\[0\]"):
            client.render_chat([{"role": "robot", "content": "x"}])
    assert engine.calls(TOKENIZE_PATH) == 0


def test_render_chat_without_a_template_is_the_engines_400(make_engine: object) -> None:
    """A model without a chat template: the engine's 400 is raised at once (not retried)."""
    engine = make_engine(chat_template=False)  # type: ignore[operator]
    with SamplerClient(engine.url, retry=FAST) as client:
        with pytest.raises(EngineStatusError) as raised:
            client.render_chat(MESSAGES)
    assert raised.value.status == 400 and "chat template" in str(raised.value)
    assert engine.calls(TOKENIZE_PATH) == 1
