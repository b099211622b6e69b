"""FakeEngine over real loopback sockets: its bodies, resolver, load/unload, LRU death, faults and plumbing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from lora_sampler.testing import FakeEngine, _bodies, decode_token, encode_text, write_adapter

BASE = "tiny-base"
PROMPT = [1, 2, 3]
EngineFactory = Callable[..., FakeEngine]


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Every engine a test starts is stopped with all its threads joined by the end of the test."""
    yield
    assert [t.name for t in threading.enumerate() if t.name.startswith("FakeEngine")] == []


def post(engine: FakeEngine, path: str, body: Any, **kwargs: Any) -> requests.Response:
    return requests.post(engine.url + path, json=body, timeout=10, **kwargs)


def complete(engine: FakeEngine, model: str = BASE, prompt: Any = PROMPT, **params: Any) -> requests.Response:
    return post(engine, "/v1/completions", {"model": model, "prompt": prompt, **params})


def load(engine: FakeEngine, name: str, path: Any, **extra: Any) -> requests.Response:
    return post(engine, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": os.fspath(path), **extra})


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a state change, not a duration) for up to 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.005)


def is_listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except OSError:
        return False
    return True


def assert_body(response: requests.Response, expected: _bodies.VllmBody) -> None:
    assert response.status_code == expected.status
    assert response.content == expected.body
    assert response.headers.get("Content-Type") == expected.content_type


# -- plumbing ---------------------------------------------------------------------------------------------------------


def test_engine_binds_loopback_with_url_without_v1(engine: FakeEngine) -> None:
    """The engine listens on 127.0.0.1 at an OS-chosen port and its url has no /v1."""
    assert engine.port > 0
    assert engine.url == f"http://127.0.0.1:{engine.port}"
    assert requests.get(engine.url + "/health", timeout=10).status_code == 200


def test_engine_keeps_connections_alive(engine: FakeEngine) -> None:
    """A requests.Session reuses one TCP connection for many answers, errors included."""
    with requests.Session() as session:
        for model in (BASE, "ghost", BASE, BASE):
            session.post(engine.url + "/v1/completions", json={"model": model, "prompt": PROMPT}, timeout=10)
    assert engine.connections_opened == 1


def test_engine_stop_closes_connections_and_threads(lora_dir: Path) -> None:
    """stop() closes idle keep-alive connections, joins every thread, refuses new ones, and is idempotent."""
    before = set(threading.enumerate())
    engine = FakeEngine(lora_dir=lora_dir).start()
    session = requests.Session()
    assert session.get(engine.url + "/v1/models", timeout=10).status_code == 200
    url = engine.url
    engine.stop()
    engine.stop()
    assert set(threading.enumerate()) <= before
    with pytest.raises(requests.ConnectionError):
        session.get(url + "/v1/models", timeout=10)
    session.close()


def test_engine_starts_once(engine: FakeEngine) -> None:
    """A second start() raises instead of binding again."""
    with pytest.raises(RuntimeError):
        engine.start()


def test_engine_context_manager_starts_and_stops(lora_dir: Path) -> None:
    """`with FakeEngine(...)` serves inside the block and refuses connections after it."""
    with FakeEngine(lora_dir=lora_dir) as engine:
        url = engine.url
        assert complete(engine).status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=10)


def test_engine_fixed_port_is_honoured(lora_dir: Path) -> None:
    """port= binds that port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with FakeEngine(lora_dir=lora_dir, port=port) as engine:
        assert engine.port == port


def test_engine_is_quiet_on_stderr(make_engine: EngineFactory, capfd: pytest.CaptureFixture[str]) -> None:
    """Requests, faults and vanishing clients print nothing to stdout or stderr."""
    engine = make_engine()
    complete(engine)
    engine.inject_fault("refuse")
    engine.inject_fault("drop")
    for _ in range(2):
        with pytest.raises(requests.ConnectionError):
            complete(engine)
    with socket.create_connection(("127.0.0.1", engine.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    engine.stop()
    assert capfd.readouterr() == ("", "")


def test_engine_reads_chunked_bodies(engine: FakeEngine) -> None:
    """A chunked request body is read like a Content-Length one."""
    body = json.dumps({"model": BASE, "prompt": PROMPT}).encode()
    response = requests.post(engine.url + "/v1/completions", data=iter([body[:5], body[5:]]), timeout=10)
    assert response.status_code == 200


# -- auth, health, models ---------------------------------------------------------------------------------------------


def test_auth_guards_v1_but_not_health(make_engine: EngineFactory) -> None:
    """With a key, /v1/* needs the exact Bearer header (401 body verbatim); /health and /ping never do."""
    engine = make_engine(api_key="sekrit")
    health = requests.get(engine.url + "/health", timeout=10)
    assert (health.status_code, health.content) == (200, b"")
    assert requests.get(engine.url + "/ping", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}, {"x-api-key": "sekrit"}):
        assert_body(requests.get(engine.url + "/v1/models", headers=headers, timeout=10), _bodies.unauthorized())
    ok = requests.get(engine.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}, timeout=10)
    assert ok.status_code == 200


def test_auth_checked_before_model(make_engine: EngineFactory) -> None:
    """A wrong key with an unknown model gives 401, not 404."""
    engine = make_engine(api_key="sekrit")
    assert_body(complete(engine, "ghost"), _bodies.unauthorized())


def test_auth_log_records_presence_never_the_key(make_engine: EngineFactory) -> None:
    """The request log says whether Authorization was sent, and never holds its value."""
    engine = make_engine(api_key="sekrit")
    headers = {"Authorization": "Bearer sekrit", "X-Session-ID": "s-1"}
    post(engine, "/v1/completions", {"model": BASE, "prompt": PROMPT}, headers=headers)
    complete(engine)
    first, second = engine.requests
    assert (first.has_auth, first.session_id, first.status) == (True, "s-1", 200)
    assert (second.has_auth, second.session_id, second.status) == (False, None, 401)
    assert "sekrit" not in repr(engine.requests)


def test_models_lists_base_then_adapters(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """/v1/models has the base card, then one card per registered adapter with its root and parent."""
    write_adapter(lora_dir / "alpha", BASE)
    gamma = write_adapter(tmp_path / "gamma", BASE)
    assert complete(engine, "alpha").status_code == 200
    assert load(engine, "gamma", gamma).status_code == 200
    data = requests.get(engine.url + "/v1/models", timeout=10).json()
    base, alpha, gamma_card = data["data"]
    assert data["object"] == "list"
    assert (base["id"], base["root"], base["parent"], base["max_model_len"]) == (BASE, BASE, None, 256)
    assert (base["object"], base["owned_by"]) == ("model", "vllm")
    assert (alpha["id"], alpha["root"], alpha["parent"]) == ("alpha", str(lora_dir / "alpha"), BASE)
    assert (gamma_card["root"], gamma_card["max_model_len"]) == (gamma, None)


def test_routes_unknown_path_404_detail(engine: FakeEngine) -> None:
    """Unknown paths answer starlette's 404 {"detail":"Not Found"}."""
    assert_body(requests.get(engine.url + "/v1/tokenize", timeout=10), _bodies.route_not_found())


# -- completions ------------------------------------------------------------------------------------------------------


def test_completion_base_has_vllm_shape(engine: FakeEngine) -> None:
    """A base completion has vLLM's fields, usage, and null extras unless asked for."""
    response = complete(engine, max_tokens=5)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == BASE and body["id"].startswith("cmpl-")
    assert body["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 8,
        "completion_tokens": 5,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    (choice,) = body["choices"]
    assert (choice["index"], choice["finish_reason"], choice["stop_reason"]) == (0, "length", None)
    assert choice["logprobs"] is None and choice["token_ids"] is None and choice["prompt_logprobs"] is None


def test_completion_return_token_ids_and_text(engine: FakeEngine) -> None:
    """return_token_ids adds token_ids and prompt_token_ids; text is the tokens decoded."""
    (choice,) = complete(engine, max_tokens=6, return_token_ids=True).json()["choices"]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 6
    assert choice["text"] == "".join(decode_token(t) for t in choice["token_ids"])


def test_completion_text_prompt_tokenized_as_bytes(engine: FakeEngine) -> None:
    """A string prompt becomes one token per UTF-8 byte, id 4 + byte."""
    (choice,) = complete(engine, prompt="hé", return_token_ids=True).json()["choices"]
    assert choice["prompt_token_ids"] == encode_text("hé") == [4 + 104, 4 + 0xC3, 4 + 0xA9]


def test_completion_seed_is_deterministic(engine: FakeEngine) -> None:
    """The same seed repeats each choice; choices differ from one another."""
    first = complete(engine, n=3, seed=7, max_tokens=8, return_token_ids=True).json()["choices"]
    again = complete(engine, n=3, seed=7, max_tokens=8, return_token_ids=True).json()["choices"]
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in again]
    assert len({tuple(c["token_ids"]) for c in first}) == 3
    assert [c["index"] for c in first] == [0, 1, 2]


def test_completion_stop_token_id(engine: FakeEngine) -> None:
    """A stop token id ends the choice with finish_reason stop and that id as stop_reason."""
    ids = complete(engine, seed=3, max_tokens=10, return_token_ids=True).json()["choices"][0]["token_ids"]
    stop = ids[4]
    (choice,) = complete(engine, seed=3, max_tokens=10, stop_token_ids=[stop], return_token_ids=True).json()["choices"]
    cut = ids.index(stop) + 1
    assert choice["token_ids"] == ids[:cut]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_completion_stop_string_truncates_text(engine: FakeEngine) -> None:
    """A stop string ends the choice; the text stops just before it."""
    text = complete(engine, seed=5, max_tokens=10).json()["choices"][0]["text"]
    stop = text[12:15]
    (choice,) = complete(engine, seed=5, max_tokens=10, stop=[stop]).json()["choices"]
    assert choice["text"] == text[: text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_completion_logprobs_shape(engine: FakeEngine) -> None:
    """logprobs=k gives per-token logprobs, tokens, offsets and top-k dicts including the sampled token."""
    (choice,) = complete(engine, max_tokens=5, logprobs=3, return_token_ids=True).json()["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [decode_token(t) for t in choice["token_ids"]]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert logprobs["text_offset"][0] == 0
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and top[token] == value == max(top.values()) and value < 0


def test_completion_prompt_logprobs_shape(engine: FakeEngine) -> None:
    """prompt_logprobs=k: null first, then k or k+1 entries keyed by id string, the prompt token included."""
    prompt = [10, 11, 12, 13, 14, 15]
    (choice,) = complete(engine, prompt=prompt, prompt_logprobs=2).json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for token, entry in zip(prompt[1:], entries[1:]):
        assert str(token) in entry and len(entry) in (2, 3)
        assert entry[str(token)]["decoded_token"] == decode_token(token)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())


def test_completion_length_limits_verbatim(engine: FakeEngine) -> None:
    """Over-length prompts and max_tokens get vLLM's 400s; prompt + max_tokens over the limit is clamped."""
    assert_body(complete(engine, prompt=[5] * 300), _bodies.prompt_too_long(256, 300))
    assert_body(complete(engine, max_tokens=1000), _bodies.max_tokens_too_large(1000, 256))
    assert_body(complete(engine, prompt=[5] * 256, max_tokens=1), _bodies.max_tokens_zero())
    clamped = complete(engine, prompt=[5] * 250, max_tokens=10).json()
    assert clamped["usage"]["completion_tokens"] == 6 and clamped["usage"]["total_tokens"] == 256


def test_completion_token_out_of_vocab(engine: FakeEngine) -> None:
    """A prompt token id at or above vocab_size is a 400 naming the id."""
    assert_body(complete(engine, prompt=[1, 5000]), _bodies.token_out_of_vocab(5000))


def test_vocabulary_bounds_are_the_tokenizers(engine: FakeEngine) -> None:
    """A vocab_size without room for the bytes is refused naming it; /detokenize answers a 400 naming an id that is
    no int or outside the vocabulary (both checked once, by the engine's ByteTokenizer)."""
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 260 .*got 100"):
        FakeEngine(vocab_size=100)
    assert post(engine, "/detokenize", {"tokens": [76, 109]}).json() == {"prompt": "Hi"}
    for tokens, named in (([5, "a"], "'a'"), ([5, 1024], "1024")):
        answer = post(engine, "/detokenize", {"tokens": tokens})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == f"token id {named} is not in the vocabulary (0..1023)"


def test_completion_unknown_model_before_length(engine: FakeEngine) -> None:
    """An unknown model gets the generic 404 even with an over-length prompt."""
    assert_body(complete(engine, "ghost", prompt=[5] * 300), _bodies.model_not_found("ghost", BASE))


def test_completion_old_error_shape(make_engine: EngineFactory) -> None:
    """old_error_shape=True puts message/type/param/code at the top level."""
    engine = make_engine(old_error_shape=True)
    assert_body(complete(engine, "ghost"), _bodies.model_not_found("ghost", BASE).older())
    assert complete(engine, "ghost").json()["message"].startswith("The model `ghost` does not exist.")


# -- lazy resolver ----------------------------------------------------------------------------------------------------


def test_resolver_loads_on_first_request(engine: FakeEngine, lora_dir: Path) -> None:
    """A valid adapter directory is served on its first request and registered."""
    write_adapter(lora_dir / "alpha", BASE)
    response = complete(engine, "alpha")
    assert response.status_code == 200 and response.json()["model"] == "alpha"
    assert engine.loaded_adapters == ["alpha"] and engine.resolver_loads == 1


def test_resolver_ignores_foreign_adapters(engine: FakeEngine, lora_dir: Path) -> None:
    """Another base model, a non-LORA peft_type, an empty or config-less directory all get the generic 404."""
    write_adapter(lora_dir / "other", "other-base")
    write_adapter(lora_dir / "ia3", BASE, peft_type="IA3")
    (lora_dir / "empty").mkdir()
    for name in ("other", "ia3", "empty", "missing"):
        assert_body(complete(engine, name), _bodies.model_not_found(name, BASE))
    assert engine.loaded_adapters == []


@pytest.mark.parametrize("text", ["", '{\n  "peft_type": "LO', '{"r" 8}'])
def test_resolver_half_written_config_json_error(engine: FakeEngine, lora_dir: Path, text: str) -> None:
    """A config that is not JSON yet gives 400 with the json decoder's own text."""
    (lora_dir / "half").mkdir()
    (lora_dir / "half" / "adapter_config.json").write_text(text)
    response = complete(engine, "half")
    assert_body(response, _bodies.adapter_config_json_error(text))
    assert response.json()["error"]["message"] == _bodies.json_decode_message(text) != ""


def test_resolver_missing_weights_then_not_poisoned(engine: FakeEngine, lora_dir: Path) -> None:
    """Config without weights is 400 found-but-not-loaded; once weights land the next request is 200."""
    write_adapter(lora_dir / "late", BASE)
    weights = lora_dir / "late" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    assert_body(complete(engine, "late"), _bodies.adapter_not_loadable("late"))
    weights.write_bytes(data[: len(data) - 7])
    assert_body(complete(engine, "late"), _bodies.adapter_not_loadable("late"))
    weights.write_bytes(b"")
    assert_body(complete(engine, "late"), _bodies.adapter_not_loadable("late"))
    weights.write_bytes(data)
    assert complete(engine, "late").status_code == 200


def test_resolver_rank_above_max_is_not_loadable(engine: FakeEngine, lora_dir: Path) -> None:
    """r greater than max_lora_rank is the same 400."""
    write_adapter(lora_dir / "r16", BASE, rank=16)
    assert_body(complete(engine, "r16"), _bodies.adapter_not_loadable("r16"))


def test_resolver_serializes_concurrent_first_requests(make_engine: EngineFactory, lora_dir: Path) -> None:
    """Concurrent first requests for one name all succeed and load it once."""
    engine = make_engine(load_latency=0.2)
    write_adapter(lora_dir / "hot", BASE)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: complete(engine, "hot").status_code, range(8)))
    assert statuses == [200] * 8 and engine.resolver_loads == 1


def test_resolver_off_with_runtime_updating_off(make_engine: EngineFactory, lora_dir: Path) -> None:
    """With runtime updating off, a valid directory gets the 404 and load/unload answer detail Not Found."""
    engine = make_engine(runtime_lora_updating=False)
    write_adapter(lora_dir / "alpha", BASE)
    assert_body(complete(engine, "alpha"), _bodies.model_not_found("alpha", BASE))
    assert_body(load(engine, "alpha", lora_dir / "alpha"), _bodies.route_not_found())
    assert_body(post(engine, "/v1/unload_lora_adapter", {"lora_name": "alpha"}), _bodies.route_not_found())
    engine.set_runtime_lora_updating(True)
    assert complete(engine, "alpha").status_code == 200


def test_visibility_delay_counts_requests(engine: FakeEngine, lora_dir: Path) -> None:
    """set_visibility_delay(requests=2) hides the directory for exactly two answered completions."""
    write_adapter(lora_dir / "lag", BASE)
    engine.set_visibility_delay("lag", requests=2)
    statuses = [complete(engine, "lag").status_code for _ in range(3)]
    assert statuses == [404, 404, 200]


def test_visibility_delay_hides_from_load_endpoint(engine: FakeEngine, lora_dir: Path) -> None:
    """While hidden, the load endpoint says no adapter found for the path."""
    path = write_adapter(lora_dir / "lag", BASE)
    engine.set_visibility_delay("lag", seconds=3600)
    assert_body(load(engine, "lag", path), _bodies.load_no_adapter("lag", path))
    assert complete(engine, "lag").status_code == 404


# -- load and unload --------------------------------------------------------------------------------------------------


def test_load_success_already_loaded_and_inplace(engine: FakeEngine, tmp_path: Path) -> None:
    """Load answers plain text without content-type; a second load is 400 unless load_inplace."""
    path = write_adapter(tmp_path / "gamma", BASE)
    assert_body(load(engine, "gamma", path), _bodies.load_success("gamma"))
    assert_body(load(engine, "gamma", path), _bodies.already_loaded("gamma"))
    assert_body(load(engine, "gamma", path, load_inplace=True), _bodies.load_success("gamma"))
    assert complete(engine, "gamma").status_code == 200


def test_load_error_bodies_verbatim(engine: FakeEngine, tmp_path: Path) -> None:
    """No adapter, no weights, missing lora_path and the base model's name give vLLM's bodies."""
    missing = str(tmp_path / "does-not-exist")
    assert_body(load(engine, "delta", missing), _bodies.load_no_adapter("delta", missing))
    noweights = write_adapter(tmp_path / "noweights", BASE)
    os.remove(os.path.join(noweights, "adapter_model.safetensors"))
    assert_body(load(engine, "nw", noweights), _bodies.load_no_weights(noweights))
    only_name = post(engine, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert_body(only_name, _bodies.validation_error("lora_path", 1))
    assert_body(load(engine, BASE, noweights), _bodies.base_conflict(BASE))
    assert engine.loaded_adapters == []


def test_load_error_paths_are_sanitized_like_vllm(make_engine: EngineFactory, tmp_path: Path) -> None:
    """Paths under /tmp, /root, ... in error messages read <path>, and a following period goes with them."""
    engine = make_engine(model="/root/models/tiny-model")
    missing = "/tmp/no-such-dir/does-not-exist"
    assert load(engine, "delta", missing).json()["error"]["message"] == (
        "Loading lora delta failed: No adapter found for <path>"
    )
    not_found = complete(engine, "ghost").json()["error"]["message"]
    assert not_found == "The model `ghost` does not exist. Valid aliases: <path>"
    noweights = write_adapter(tmp_path / "noweights", BASE)
    os.remove(os.path.join(noweights, "adapter_model.safetensors"))
    message = load(engine, "nw", noweights).json()["error"]["message"]
    if noweights.startswith(("/tmp/", "/root/", "/home/", "/var/")):
        assert message.startswith("Call to add_lora method failed: Worker failed with error '<path> doesn't contain")
    assert noweights not in message
    assert _bodies.sanitize_message("see /work/a/b and /work/a/c.json.") == "see /work/a/b and <path>."


def test_unload_removes_then_404(engine: FakeEngine, tmp_path: Path) -> None:
    """Unload answers plain text, then the name is unknown to unload and to completions."""
    load(engine, "gamma", write_adapter(tmp_path / "gamma", BASE))
    assert_body(post(engine, "/v1/unload_lora_adapter", {"lora_name": "gamma"}), _bodies.unload_success("gamma"))
    assert_body(post(engine, "/v1/unload_lora_adapter", {"lora_name": "gamma"}), _bodies.unload_not_found("gamma"))
    assert_body(complete(engine, "gamma"), _bodies.model_not_found("gamma", BASE))


def test_load_peak_concurrency_per_name(make_engine: EngineFactory, tmp_path: Path) -> None:
    """max_loads_in_flight counts concurrent load requests overall and per name."""
    engine = make_engine(load_latency=60.0)
    paths = {name: write_adapter(tmp_path / name, BASE) for name in ("a", "b")}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, engine, name, paths[name]) for name in ("a", "a", "a", "b")]
        wait_until(lambda: engine.loads_in_flight == 4)
        engine.load_latency = 0.0  # read while the loads sleep: lets them all finish
        answers = [future.result().status_code for future in futures]
    assert sorted(answers) == [200] * 4
    assert engine.max_loads_in_flight_for("a") == 3 and engine.max_loads_in_flight_for("b") == 1
    assert engine.max_loads_in_flight == 4 and engine.loads_in_flight == 0


# -- LRU and engine death ---------------------------------------------------------------------------------------------


@pytest.fixture
def lru_engine(make_engine: EngineFactory, lora_dir: Path) -> FakeEngine:
    """An engine holding one adapter at a time (``max_loras=1``) that served ``e1`` then ``e2``: ``e1`` is evicted
    from the LRU, its files still in ``lora_dir``."""
    engine = make_engine(max_loras=1)
    for name in ("e1", "e2"):
        write_adapter(lora_dir / name, BASE)
        assert complete(engine, name).status_code == 200
    return engine


def test_lru_reloads_evicted_adapter_from_disk(lru_engine: FakeEngine) -> None:
    """An adapter evicted from the LRU stays registered and is reloaded while its files exist."""
    assert lru_engine.cached_adapters == ["e2"] and lru_engine.loaded_adapters == ["e1", "e2"]
    assert complete(lru_engine, "e1").status_code == 200
    assert lru_engine.cached_adapters == ["e1"]


def test_lru_deleted_evicted_adapter_kills_engine(lru_engine: FakeEngine, lora_dir: Path) -> None:
    """Using an evicted adapter whose directory is gone: 500 EngineCore, then connections are refused."""
    shutil.rmtree(lora_dir / "e1")
    assert_body(complete(lru_engine, "e1"), _bodies.engine_dead())
    assert lru_engine.is_dead
    wait_until(lambda: not is_listening(lru_engine.port))
    with pytest.raises(requests.ConnectionError):
        requests.get(lru_engine.url + "/health", timeout=10)


def test_lru_death_fails_in_flight_requests(lru_engine: FakeEngine, lora_dir: Path) -> None:
    """Requests in flight when the engine dies also get the EngineCore 500."""
    shutil.rmtree(lora_dir / "e1")
    lru_engine.latency = 60.0  # cut short by the death
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(complete, lru_engine)
        wait_until(lambda: lru_engine.requests_in_flight == 1)
        assert_body(complete(lru_engine, "e1"), _bodies.engine_dead())
        assert_body(slow.result(), _bodies.engine_dead())


def test_lru_unload_before_delete_is_safe(lru_engine: FakeEngine, lora_dir: Path) -> None:
    """Unloading first, then deleting, leaves the engine healthy: the name is just a 404."""
    post(lru_engine, "/v1/unload_lora_adapter", {"lora_name": "e1"})
    shutil.rmtree(lora_dir / "e1")
    assert complete(lru_engine, "e1").status_code == 404 and not lru_engine.is_dead


# -- faults and the request log ---------------------------------------------------------------------------------------


def test_fault_status_and_503_bodies(engine: FakeEngine) -> None:
    """'status' answers a vLLM-shaped scripted error; '503' answers the retry body; then service resumes."""
    engine.inject_fault("status", status=500)
    engine.inject_fault("503")
    assert complete(engine).json()["error"] == {
        "message": "scripted 500",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert_body(complete(engine), _bodies.retry_later())
    assert complete(engine).status_code == 200


@pytest.mark.parametrize("kind", ["refuse", "drop", "hang"])
def test_fault_transport_kinds_raise_connection_error(engine: FakeEngine, kind: str) -> None:
    """refuse (RST), drop (close) and hang-then-drop surface as requests.ConnectionError, logged with status 0."""
    engine.inject_fault(kind, seconds=0.05)
    with pytest.raises(requests.ConnectionError):
        complete(engine)
    (record,) = engine.requests
    assert (record.fault, record.status) == (kind, 0)
    assert complete(engine).status_code == 200


def test_fault_refuse_resets_raw_socket(engine: FakeEngine) -> None:
    """'refuse' resets the TCP connection (ECONNRESET) instead of closing it cleanly."""
    engine.inject_fault("refuse", path="/v1/models")
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(ConnectionResetError):
            while sock.recv(4096):
                pass


def test_fault_matches_count_model_and_path(engine: FakeEngine, lora_dir: Path) -> None:
    """A fault hits only its path and model, count times; clear_faults drops the rest."""
    write_adapter(lora_dir / "alpha", BASE)
    engine.inject_fault("503", model="alpha", count=2)
    engine.inject_fault("503", path="/v1/load_lora_adapter")
    assert complete(engine).status_code == 200
    assert [complete(engine, "alpha").status_code for _ in range(3)] == [503, 503, 200]
    engine.clear_faults()
    assert load(engine, "beta", lora_dir / "alpha").status_code == 200


def test_fault_rejects_unknown_kind(engine: FakeEngine) -> None:
    """inject_fault validates its kind."""
    with pytest.raises(ValueError):
        engine.inject_fault("explode")


def test_log_calls_and_reset(engine: FakeEngine, lora_dir: Path) -> None:
    """calls() counts by path and model (lora_name for loads); reset_log clears the log."""
    write_adapter(lora_dir / "alpha", BASE)
    complete(engine)
    complete(engine, "alpha")
    load(engine, "alpha", lora_dir / "alpha")
    assert engine.calls("/v1/completions") == 2 and engine.calls("/v1/completions", "alpha") == 1
    assert engine.calls("/v1/load_lora_adapter", "alpha") == 1
    assert [r.status for r in engine.requests] == [200, 200, 400]
    assert all(r.started <= r.finished for r in engine.requests)
    engine.reset_log()
    assert engine.requests == [] and engine.connections_opened == 0


# -- pytest plugin ----------------------------------------------------------------------------------------------------

PLUGIN_TEST = """
import requests

def test_fixture(lora_engine):
    from lora_sampler import retry
    assert retry.is_testing()
    assert lora_engine.lora_dir.endswith("loras")
    assert requests.get(lora_engine.url + "/health", timeout=10).status_code == 200
"""


def test_plugin_lora_engine_fixture_serves_and_switches_testing(tmp_path: Path) -> None:
    """The lora_engine fixture yields a running engine with a resolver dir and retry waits switched off."""
    (tmp_path / "test_inner.py").write_text(PLUGIN_TEST)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # so an installed pytest11 entry point does not load it twice
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "lora_sampler.testing.pytest_plugin",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run([*command, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
