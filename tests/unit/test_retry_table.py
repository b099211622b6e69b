"""The retry table (docs/guides/retries.md), row by row, for adapter and base-model requests.

Each row runs once, through ``responses``: it patches requests' transport adapter, which is the path every request
of the client takes (``Session.send`` and the session's mounted adapter), so there is no second path to cover.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import requests
import responses

import lora_sampler
from lora_sampler import RetryEvent, RetryPolicy, SamplerClient
from lora_sampler.testing import _bodies

BASE = "http://engine.test"
COMPLETIONS_PATH = "/v1/completions"
LOAD_PATH = "/v1/load_lora_adapter"
COMPLETIONS = BASE + COMPLETIONS_PATH
LOAD = BASE + LOAD_PATH
ADAPTER = "step-400"


def ok_body(model: str = ADAPTER) -> dict:
    """A minimal vLLM completion answer with one choice of two tokens."""
    choice = _bodies.completion_choice(
        0,
        "ab",
        logprobs={
            "token_logprobs": [-0.5, -1.5],
            "tokens": ["a", "b"],
            "text_offset": [0, 1],
            "top_logprobs": [{"a": -0.5}, {"b": -1.5}],
        },
        finish_reason="length",
        token_ids=[7, 8],
        prompt_token_ids=[1, 2, 3],
    )
    return _bodies.completion_data("cmpl-1", 1, model, [choice], 3, 2)


def add_failure(body: Any) -> None:
    """Register one failing answer: a ``VllmBody`` or an exception raised by the transport."""
    if isinstance(body, Exception):
        responses.add(responses.POST, COMPLETIONS, body=body)
    else:
        responses.add(responses.POST, COMPLETIONS, body=body.body, status=body.status, content_type=body.content_type)


def calls_to(url: str) -> int:
    return sum(1 for call in responses.calls if call.request.url == url)


def posts() -> List[Any]:
    """The POSTs sent (a bare adapter name not in lora_base_dir is first looked up with GET /v1/models)."""
    return [call for call in responses.calls if call.request.method == "POST"]


def make_client(tmp_path: Any, **kwargs: Any) -> SamplerClient:
    return SamplerClient(BASE, lora_base_dir=tmp_path, **kwargs)


RETRIED_FOR_ADAPTERS = {
    "transport error": requests.ConnectionError("connection refused"),
    "read timeout": requests.ReadTimeout("read timed out"),
    "404 not visible yet": _bodies.model_not_found(ADAPTER, "tiny-base"),
    "404 older shape": _bodies.model_not_found(ADAPTER, "tiny-base").older(),
    "400 does not exist": _bodies.bad_request(f"The model `{ADAPTER}` does not exist."),
    "400 not found": _bodies.bad_request(f"Model {ADAPTER} not found"),
    "400 found but not loaded": _bodies.adapter_not_loadable(ADAPTER),
    "400 zero-byte config": _bodies.adapter_config_json_error(""),
    "400 half-written config": _bodies.adapter_config_json_error('{\n  "peft_type": "LO'),
}
NEVER_RETRIED = {
    "400 over-length prompt": _bodies.prompt_too_long(256, 300),
    "400 max_tokens": _bodies.max_tokens_too_large(1000, 256),
    "400 out of vocabulary": _bodies.token_out_of_vocab(5000),
    "401": _bodies.unauthorized(),
    "403": _bodies.error(403, "Forbidden", "PermissionDenied"),
    "422": _bodies.error(422, "Unprocessable", "UnprocessableEntity"),
    "429": _bodies.error(429, "Too many requests", "RateLimitError"),
    "409 other 4xx": _bodies.error(409, "Conflict", "Conflict"),
    "500": _bodies.engine_dead(),
    "502": _bodies.error(502, "Bad gateway", "BadGateway"),
    "503": _bodies.retry_later(),
}


class ScriptedEngine:
    """Answers each path from a script, in order (the last answer repeats), through ``responses``.

    An answer is a ``VllmBody``, a JSON dict (a 200), or an exception the transport raises
    (``requests.ConnectionError``, ``requests.ReadTimeout``).
    """

    url = BASE

    def __init__(self) -> None:
        self.script: Dict[str, List[Any]] = {}
        self.seen: List[Tuple[str, Dict[str, str], bytes]] = []
        self._mock = responses.RequestsMock(assert_all_requests_are_fired=False)

    def add(self, path: str, answer: Any) -> None:
        self.script.setdefault(path, []).append(answer)

    def calls(self, path: str) -> int:
        return sum(1 for seen, _, _ in self.seen if seen == path)

    def bodies(self, path: str) -> List[Any]:
        return [json.loads(body) for seen, _, body in self.seen if seen == path]

    def next_answer(self, path: str) -> Any:
        answers = self.script[path]
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def __enter__(self) -> ScriptedEngine:
        self._mock.__enter__()
        for path in (COMPLETIONS_PATH, LOAD_PATH):
            self._mock.add_callback(responses.POST, BASE + path, callback=self._answer)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._mock.__exit__(*exc_info)

    def _answer(self, request: Any) -> Any:
        path = request.path_url
        self.seen.append((path, dict(request.headers), request.body or b""))
        answer = self.next_answer(path)
        if isinstance(answer, Exception):
            raise answer
        status, content, content_type = _parts(answer)
        return status, {"Content-Type": content_type}, content


def _parts(answer: Any) -> Tuple[int, bytes, str]:
    if isinstance(answer, dict):
        return 200, json.dumps(answer).encode(), "application/json"
    return answer.status, answer.body, answer.content_type or "text/plain"


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    """A scripted engine behind requests' patched transport adapter."""
    with ScriptedEngine() as scripted:
        yield scripted


def scripted_client(engine: ScriptedEngine, tmp_path: Any, **kwargs: Any) -> SamplerClient:
    """A client for ``engine``."""
    return SamplerClient(engine.url, lora_base_dir=tmp_path, timeout=(5.0, 1.0), **kwargs)


@pytest.mark.parametrize("failure", list(RETRIED_FOR_ADAPTERS.values()), ids=list(RETRIED_FOR_ADAPTERS))
def test_retry_table_adapter_row_retries_after_one_load(
    failure: Any, engine: ScriptedEngine, tmp_path: Any, no_waits: None
) -> None:
    """An adapter request self-heals through each retriable failure, with exactly one load between."""
    engine.add(COMPLETIONS_PATH, failure)
    engine.add(COMPLETIONS_PATH, ok_body())
    engine.add(LOAD_PATH, _bodies.load_success(ADAPTER))
    with scripted_client(engine, tmp_path) as client:
        output = client.sample([1, 2, 3], adapter=ADAPTER)
    assert output.sequences[0].tokens == (7, 8)
    assert engine.calls(COMPLETIONS_PATH) == 2
    assert engine.calls(LOAD_PATH) == 1
    assert engine.bodies(LOAD_PATH) == [{"lora_name": ADAPTER, "lora_path": str(tmp_path / ADAPTER)}]


@pytest.mark.parametrize("failure", list(RETRIED_FOR_ADAPTERS.values()), ids=list(RETRIED_FOR_ADAPTERS))
def test_retry_table_base_model_row(failure: Any, engine: ScriptedEngine, tmp_path: Any, no_waits: None) -> None:
    """A base-model request retries transport errors without a load, and raises model errors at once."""
    engine.add(COMPLETIONS_PATH, failure)
    engine.add(COMPLETIONS_PATH, ok_body("tiny-base"))
    transport = isinstance(failure, Exception)
    with scripted_client(engine, tmp_path) as client:
        if transport:
            assert client.sample([1, 2, 3], base_model="tiny-base").sequences
        else:
            with pytest.raises(lora_sampler.EngineStatusError) as info:
                client.sample([1, 2, 3], base_model="tiny-base")
            assert info.value.attempts == 1
            assert info.value.status == failure.status
    assert engine.calls(COMPLETIONS_PATH) == (2 if transport else 1)
    assert engine.calls(LOAD_PATH) == 0


@pytest.mark.parametrize("adapter", [True, False], ids=["adapter", "base"])
@pytest.mark.parametrize("failure", list(NEVER_RETRIED.values()), ids=list(NEVER_RETRIED))
def test_retry_table_real_errors_raise_after_one_attempt(
    failure: Any, adapter: bool, engine: ScriptedEngine, tmp_path: Any, no_waits: None
) -> None:
    """Other 4xx and every 5xx surface at once, as a requests.HTTPError with the engine's message."""
    engine.add(COMPLETIONS_PATH, failure)
    target = {"adapter": ADAPTER} if adapter else {"base_model": "tiny-base"}
    giveups: List[RetryEvent] = []
    with scripted_client(engine, tmp_path, retry=RetryPolicy(on_giveup=giveups.append)) as client:
        with pytest.raises(requests.HTTPError) as info:
            client.sample([1, 2, 3], **target)
    error = info.value
    assert isinstance(error, lora_sampler.EngineStatusError)
    assert error.status == failure.status
    assert error.response is not None and error.response.status_code == failure.status
    assert failure.message[:40] in str(error)
    assert error.attempts == 1
    assert engine.calls(COMPLETIONS_PATH) == 1 and engine.calls(LOAD_PATH) == 0
    assert giveups == []  # on_giveup is only for exhausted retries


@responses.activate
def test_retry_exhaustion_makes_six_attempts_and_five_loads(tmp_path: Any, no_waits: None) -> None:
    """A persistent 404 ends after 6 attempts and 5 loads with an error naming attempts, model and message."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, LOAD, body=_bodies.load_no_adapter(ADAPTER, "/x").body, status=404)
    retries: List[RetryEvent] = []
    giveups: List[RetryEvent] = []
    policy = RetryPolicy(on_retry=retries.append, on_giveup=giveups.append)
    with make_client(tmp_path, retry=policy, api_key="sk-secret-key") as client:
        with pytest.raises(lora_sampler.ModelNotFoundError) as info:
            client.sample([1, 2, 3], adapter=ADAPTER)
    error = info.value
    assert calls_to(COMPLETIONS) == 6 and calls_to(LOAD) == 5
    assert error.attempts == 6 and error.model == ADAPTER and error.adapter
    message = str(error)
    assert "6 attempts" in message and ADAPTER in message and "does not exist" in message
    assert "sk-secret-key" not in message and "sk-secret-key" not in repr(error)
    assert [event.attempt for event in retries] == [1, 2, 3, 4, 5]
    assert len(giveups) == 1 and giveups[0].attempt == 6 and giveups[0].adapter


@responses.activate
def test_retry_happy_path_is_one_request_without_retry(tmp_path: Any) -> None:
    """Success on the first attempt sends one request, no load, and fires no retry hook."""
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    retries: List[RetryEvent] = []
    with make_client(tmp_path, retry=RetryPolicy(on_retry=retries.append)) as client:
        client.sample([1, 2, 3], adapter=ADAPTER)
    assert len(posts()) == 1 and retries == []


@responses.activate
def test_retry_load_uses_its_own_timeout_and_session_header(tmp_path: Any, no_waits: None) -> None:
    """The proactive load carries load_timeout and the sample's X-Session-ID."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    responses.add(responses.POST, LOAD, body=_bodies.already_loaded(ADAPTER).body, status=400)
    with make_client(tmp_path, retry=RetryPolicy(load_timeout=3.5), timeout=(2.0, 30.0)) as client:
        client.sample([1, 2, 3], adapter=ADAPTER, session_id="sess-A")
    first, load, _ = posts()
    assert load.request.req_kwargs["timeout"] == 3.5
    assert first.request.req_kwargs["timeout"] == (2.0, 30.0)
    assert {c.request.headers["X-Session-ID"] for c in posts()} == {"sess-A"}


@responses.activate
def test_retry_fresh_session_id_per_call_shared_by_its_retries(tmp_path: Any, no_waits: None) -> None:
    """Without session_id, each call sends a fresh one, shared by its retries and its load."""
    for _ in range(2):
        add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
        responses.add(responses.POST, COMPLETIONS, json=ok_body())
    responses.add(responses.POST, LOAD, body=_bodies.load_success(ADAPTER).body)
    with make_client(tmp_path) as client:
        client.sample([1], adapter=ADAPTER)
        client.sample([1], adapter=ADAPTER)
    ids = [c.request.headers["X-Session-ID"] for c in posts()]
    assert len(ids) == 6 and len(set(ids[:3])) == 1 and len(set(ids[3:])) == 1 and ids[0] != ids[3]


@responses.activate
def test_retry_load_failure_never_fails_the_sample(tmp_path: Any, no_waits: None) -> None:
    """A load answered 404 {"detail":"Not Found"} (runtime updating off) or a transport error is harmless."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    responses.add(responses.POST, LOAD, body=_bodies.route_not_found().body, status=404)
    responses.add(responses.POST, LOAD, body=requests.ConnectionError("refused"))
    with make_client(tmp_path) as client:
        assert client.sample([1], adapter=ADAPTER).sequences[0].tokens == (7, 8)
    assert calls_to(LOAD) == 2


@responses.activate
def test_retry_without_resolver_dir_sends_no_load(no_waits: None) -> None:
    """With no lora_base_dir the engine path is unknown, so the retry goes on without a load."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    with SamplerClient(BASE) as client:
        client.sample([1], adapter=ADAPTER)
    assert calls_to(LOAD) == 0 and calls_to(COMPLETIONS) == 2


@responses.activate
def test_retry_engine_lora_base_dir_is_the_load_path(tmp_path: Any, no_waits: None) -> None:
    """engine_lora_base_dir (the engine's view of the directory) is what the load request names."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    responses.add(responses.POST, LOAD, body=_bodies.load_success(ADAPTER).body)
    with make_client(tmp_path, engine_lora_base_dir="/mnt/loras") as client:
        client.sample([1], adapter=ADAPTER)
    assert json.loads(posts()[1].request.body)["lora_path"] == "/mnt/loras/" + ADAPTER


IN_AN_HOUR = email.utils.formatdate(time.time() + 3600, usegmt=True)


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize(
    ("retry_after", "honoured"), [("1", True), (IN_AN_HOUR, True), ("soon", False)], ids=["seconds", "date", "bad"]
)
@responses.activate
def test_retry_overloaded_opt_in_honours_retry_after(
    status: int, retry_after: str, honoured: bool, tmp_path: Any
) -> None:
    """With retry_overloaded, 429/503 are retried; Retry-After (seconds or a date, capped at max_delay) sets the wait.

    An unreadable Retry-After falls back to the normal schedule (urllib3's parser decides what is readable).
    """
    responses.add(
        responses.POST,
        COMPLETIONS,
        json={"error": {"message": "busy"}},
        status=status,
        headers={"Retry-After": retry_after},
    )
    responses.add(responses.POST, COMPLETIONS, json=ok_body("tiny-base"))
    waits: List[float] = []
    policy = RetryPolicy(
        retry_overloaded=True, base_delay=0.001, max_delay=0.05, on_retry=lambda e: waits.append(e.wait)
    )
    with make_client(tmp_path, retry=policy) as client:
        client.sample([1], base_model="tiny-base")
    assert calls_to(COMPLETIONS) == 2 and calls_to(LOAD) == 0
    assert waits == [0.05] if honoured else waits[0] <= 0.001


@responses.activate
def test_retry_hook_that_raises_never_replaces_the_engine_error(tmp_path: Any, no_waits: None) -> None:
    """A raising on_retry hook is logged; the sample still succeeds."""

    def broken(event: RetryEvent) -> None:
        raise RuntimeError("hook bug")

    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    with make_client(tmp_path, retry=RetryPolicy(on_retry=broken)) as client:
        assert client.sample([1], adapter=ADAPTER).sequences


@responses.activate
def test_retry_logs_each_retry_at_info(tmp_path: Any, no_waits: None, caplog: Any) -> None:
    """Each retry logs 'attempt N of M' with the cause on the lora_sampler logger, without the key."""
    add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    caplog.set_level("INFO", logger="lora_sampler")
    with make_client(tmp_path, api_key="sk-secret-key") as client:
        client.sample([1], adapter=ADAPTER)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lora_sampler")]
    assert any("attempt 1 of 6" in line and "HTTP 404" in line and ADAPTER in line for line in lines)
    assert all("sk-secret-key" not in line for line in lines)


def _first_wait(events: List[RetryEvent]) -> Optional[float]:
    return events[0].wait if events else None


@responses.activate
def test_retry_waits_follow_the_documented_schedule(tmp_path: Any) -> None:
    """Real waits lie in [w/2, w] of the doubling, capped schedule (scaled down to milliseconds)."""
    for _ in range(5):
        add_failure(_bodies.model_not_found(ADAPTER, "tiny-base"))
    responses.add(responses.POST, COMPLETIONS, json=ok_body())
    responses.add(responses.POST, LOAD, body=_bodies.load_success(ADAPTER).body)
    events: List[RetryEvent] = []
    policy = RetryPolicy(base_delay=0.002, max_delay=0.008, on_retry=events.append)
    with make_client(tmp_path, retry=policy) as client:
        client.sample([1], adapter=ADAPTER)
    nominal = [0.002, 0.004, 0.008, 0.008, 0.008]
    assert len(events) == 5
    for event, wait in zip(events, nominal):
        assert wait / 2 <= event.wait <= wait
    assert all(a.elapsed <= b.elapsed for a, b in zip(events, events[1:]))
