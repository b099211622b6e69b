"""Chat (``client.chat``, ``SampleRequest(messages=...)``) against FakeEngine's ``/v1/chat/completions``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest
import requests

from lora_sampler import SamplerClient, SampleRequest, SamplingParams
from lora_sampler.errors import EngineStatusError, ModelNotFoundError
from lora_sampler.testing import CHAT_TEMPLATE, FakeEngine, encode_text, render_chat, write_adapter

CHAT = "/v1/chat/completions"
MESSAGES: List[Any] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
GREEDY = SamplingParams(max_tokens=5, temperature=0)


def test_chat_returns_token_ids_logprobs_and_text_of_each_sample(engine: FakeEngine) -> None:
    """client.chat returns num_samples replies, each with token ids, one logprob per token and the text."""
    with SamplerClient(engine.url) as client:
        out = client.chat(
            MESSAGES, base_model=engine.model, num_samples=3, sampling_params=SamplingParams(max_tokens=4)
        )
    assert len(out.sequences) == 3
    for sequence in out.sequences:
        assert len(sequence.tokens) == 4 and len(sequence.logprobs) == 4 and sequence.text
        assert all(lp < 0 for lp in sequence.logprobs) and sequence.stop_reason == "length"
    assert out.body is not None and out.body["object"] == "chat.completion"
    sent = engine.requests[-1]
    assert sent.path == CHAT and sent.model == engine.model


def test_fake_chat_template_is_the_documented_one(engine: FakeEngine) -> None:
    """The fake renders the documented template: a chat reply equals the completion of the rendered prompt."""
    rendered = render_chat(MESSAGES)
    assert rendered == "<|system|>\nBe terse.\n<|user|>\nHi\n<|assistant|>\n"
    assert "{% for message in messages %}<|{{ message['role'] }}|>" in CHAT_TEMPLATE
    with SamplerClient(engine.url) as client:
        chat = client.chat(MESSAGES, base_model=engine.model, sampling_params=GREEDY)
        completion = client.sample(rendered, base_model=engine.model, sampling_params=GREEDY)
    assert chat.sequences[0].tokens == completion.sequences[0].tokens
    assert chat.body is not None and chat.body["prompt_token_ids"] == encode_text(rendered)
    raw = requests.post(engine.url + CHAT, json={"messages": MESSAGES, "return_prompt_text": True}, timeout=10)
    assert raw.json()["prompt_text"] == rendered  # vLLM's field, as the real-engine test reads it


def test_chat_through_the_adapter_load_race(engine: FakeEngine, lora_dir: Path, no_waits: None) -> None:
    """A chat for an adapter the engine cannot see yet gets the completions 404, retries, loads, and succeeds."""
    write_adapter(lora_dir / "fresh", engine.model)
    engine.set_visibility_delay("fresh", requests=2)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        out = client.chat(MESSAGES, adapter="fresh", sampling_params=GREEDY)
    assert out.model == "fresh" and len(out.sequences[0].tokens) == 5
    statuses = [(r.path, r.status) for r in engine.requests if r.model == "fresh"]
    assert (CHAT, 404) in statuses and statuses[-1] == (CHAT, 200)
    assert engine.calls("/v1/load_lora_adapter") >= 1


def test_chat_unknown_adapter_gives_the_same_404_as_completions(engine: FakeEngine, no_waits: None) -> None:
    """The engine's 404 for an unknown adapter is the same body on both endpoints; the client raises it in the end."""
    chat = requests.post(engine.url + CHAT, json={"model": "ghost", "messages": MESSAGES}, timeout=10)
    completion = requests.post(engine.url + "/v1/completions", json={"model": "ghost", "prompt": "x"}, timeout=10)
    assert chat.status_code == completion.status_code == 404 and chat.json() == completion.json()
    with SamplerClient(engine.url) as client, pytest.raises(ModelNotFoundError) as caught:
        client.chat(MESSAGES, adapter="ghost")
    assert caught.value.attempts == 6 and "ghost" in str(caught.value)


def test_chat_without_a_template_is_a_400_raised_at_once(no_waits: None) -> None:
    """A model without a chat template answers vLLM's 400; it is raised after one attempt."""
    with FakeEngine(chat_template=False) as engine, SamplerClient(engine.url) as client:
        with pytest.raises(EngineStatusError) as caught:
            client.chat(MESSAGES, base_model=engine.model)
        assert caught.value.status == 400 and caught.value.attempts == 1
        assert "default chat template is no longer allowed" in str(caught.value)
        assert engine.calls(CHAT) == 1


@pytest.mark.parametrize(
    ("messages", "error", "phrase"),
    [
        ("Hi", TypeError, "messages must be a list"),
        ([], ValueError, "messages must not be empty"),
        ([{"role": "bot", "content": "x"}], ValueError, "messages[0] has role 'bot'"),
        ([{"role": "user"}], ValueError, "messages[0] has no 'content'"),
        ([{"role": "user", "content": 5}], TypeError, "messages[0] content must be a string"),
        (["hello"], TypeError, "messages[0] must be a dict"),
    ],
)
def test_bad_messages_are_refused_before_any_request(
    engine: FakeEngine, messages: Any, error: type, phrase: str
) -> None:
    """Bad messages raise a clear error naming the message before anything is sent."""
    with SamplerClient(engine.url) as client, pytest.raises(error) as caught:
        client.chat(messages, base_model=engine.model)
    assert phrase in str(caught.value)
    assert engine.requests == []


def test_prompt_and_messages_are_exclusive() -> None:
    """A SampleRequest is a prompt or a chat, never both or neither."""
    with pytest.raises(ValueError, match=r"exactly one of prompt= .* or messages="):
        SampleRequest("x", base_model="m", messages=MESSAGES)
    with pytest.raises(ValueError, match="exactly one of prompt="):
        SampleRequest(base_model="m")


def test_fan_out_takes_both_kinds(engine: FakeEngine) -> None:
    """submit, imap, imap_unordered and sample_many run prompt and chat requests side by side."""
    mixed = [
        SampleRequest("hello", base_model=engine.model, sampling_params=GREEDY),
        SampleRequest(messages=MESSAGES, base_model=engine.model, sampling_params=GREEDY),
        {"messages": MESSAGES, "base_model": engine.model, "sampling_params": GREEDY},
    ]
    with SamplerClient(engine.url, max_workers=2) as client:
        in_order = client.sample_many(mixed)
        unordered = dict(client.imap_unordered(mixed))
        submitted = client.submit(messages=MESSAGES, base_model=engine.model, sampling_params=GREEDY).result()
    assert [o.body["object"] for o in in_order] == ["text_completion", "chat.completion", "chat.completion"]
    assert [unordered[i].sequences[0].tokens for i in range(3)] == [o.sequences[0].tokens for o in in_order]
    assert submitted.sequences[0].tokens == in_order[1].sequences[0].tokens
    assert engine.calls(CHAT) == 5 and engine.calls("/v1/completions") == 2


def test_chat_payload_carries_token_ids_logprobs_and_extra_body() -> None:
    """A chat payload asks for token ids and logprobs, and sends extra_body fields as given."""
    request = SampleRequest(messages=MESSAGES, base_model="m", extra_body={"top_logprobs": 2, "user": "u"})
    payload = request.to_payload("m")
    assert payload["messages"] == MESSAGES and "prompt" not in payload
    assert payload["logprobs"] is True and payload["return_token_ids"] is True
    assert payload["top_logprobs"] == 2 and payload["user"] == "u"
    with pytest.raises(ValueError, match="extra_body may not set 'n'"):
        SampleRequest(messages=MESSAGES, base_model="m", extra_body={"n": 2})
    with pytest.raises(ValueError, match=r"prompt_logprobs .* apply to prompt= requests"):
        SampleRequest(messages=MESSAGES, base_model="m", prompt_logprobs=True)


def test_tiny_model_chat_template_is_the_fakes() -> None:
    """The real-engine tests' tiny model gets FakeEngine's template (the build script runs in the vLLM venv)."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "real_engine" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("build_tiny_model_for_template", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib imports only at the top
    assert module.CHAT_TEMPLATE == CHAT_TEMPLATE


def test_ray_data_rows_of_messages_are_chats(engine: FakeEngine) -> None:
    """SampleBatches (ray_data) sends a cell holding message dicts as a chat, and other cells as prompts."""
    from lora_sampler.ray_data import ClientSettings, SampleBatches

    batches = SampleBatches(ClientSettings(engine.url), base_model=engine.model, sampling_params=GREEDY)
    try:
        columns = batches.sample_rows([MESSAGES, render_chat(MESSAGES), [{"role": "bot", "content": "x"}]], [None] * 3)
    finally:
        batches.close()
    assert columns["tokens"][0] == columns["tokens"][1] and len(columns["tokens"][0][0]) == 5  # the same prompt
    assert columns["error"][:2] == [None, None] and "messages[0] has role 'bot'" in columns["error"][2]
    assert engine.calls(CHAT) == 1 and engine.calls("/v1/completions") == 1


def test_greedy_with_several_samples_is_vllms_400(engine: FakeEngine) -> None:
    """As vLLM 0.32 (seen on the real engine): temperature 0 with n > 1 is a 400, raised after one attempt."""
    with SamplerClient(engine.url) as client, pytest.raises(EngineStatusError) as caught:
        client.chat(MESSAGES, base_model=engine.model, num_samples=2, sampling_params=GREEDY)
    assert caught.value.status == 400 and "n must be 1 when using greedy sampling, got 2." in str(caught.value)
    assert caught.value.attempts == 1
