"""``lora_sampler.tinker`` keeps tinker 0.38's ``SamplingClient`` contract, on FakeEngine.

Each test fails on a1a82fa, where ``lora_sampler.tinker`` did not exist: ``sample`` blocked and returned a
``SampleOutput``, took no ``ModelInput`` or tinker ``SamplingParams``, had no future to await, and the client could
not be pickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest
from _waits import blocked_in, wait_until

from lora_sampler import SamplerClient
from lora_sampler.testing import ByteTokenizer, FakeEngine

EngineFactory = Callable[..., FakeEngine]

PROMPT = [10, 11, 12, 13, 14]


def prompt(tinker: Any, tokens: List[int] = PROMPT) -> Any:
    return tinker.ModelInput.from_ints(tokens)


def test_create_sampling_client_returns_tinkers_future_of_the_client(tinker: Any, service: Any) -> None:
    future = service.create_sampling_client(base_model="tiny-base")
    assert type(future) is tinker.BackcompatSamplingClientFuture and isinstance(future, tinker.APIFuture)
    client = future.result()
    assert isinstance(client, tinker.SamplingClient)
    assert asyncio.run(_awaited(future)) is client
    assert asyncio.run(service.create_sampling_client_async(base_model="tiny-base")).get_base_model() == "tiny-base"
    with warnings.catch_warnings(record=True) as caught:  # tinker's deprecated habit: the future used as the client
        warnings.simplefilter("always")
        response = future.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=3)).result()
    assert len(response.sequences[0].tokens) == 3
    assert any(issubclass(w.category, FutureWarning) for w in caught)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def test_sample_future_is_a_concurrent_future_and_awaitable(tinker: Any, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    params = tinker.SamplingParams(max_tokens=4, temperature=0.7, seed=3)
    futures = [client.sample(prompt(tinker), 2, params) for _ in range(4)]
    for future in futures:
        assert isinstance(future, concurrent.futures.Future) and isinstance(future, tinker.APIFuture)
        assert future.future() is future
    _, pending = concurrent.futures.wait(futures, timeout=30)
    assert not pending
    first = futures[0].result()
    assert isinstance(first, tinker.SampleResponse)
    tokens = [s.tokens for s in first.sequences]
    assert all([s.tokens for s in f.result().sequences] == tokens for f in futures[1:])  # seeded: the same answer

    async def gather() -> List[Any]:
        again = [client.sample(prompt(tinker), 2, params) for _ in range(3)]
        return [
            await again[0],
            await again[1].result_async(timeout=30),
            await asyncio.create_task(again[2].coroutine()),
        ]

    for response in asyncio.run(gather()):
        assert [s.tokens for s in response.sequences] == tokens


def test_the_response_is_tinkers_types_with_tokens_logprobs_and_stop_reasons(tinker: Any, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    response = client.sample(prompt(tinker), 3, tinker.SamplingParams(max_tokens=5)).result(timeout=30)
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert isinstance(sequence, tinker.SampledSequence)
        assert sequence.stop_reason == "length" and len(sequence.tokens) == 5
        assert sequence.logprobs is not None and len(sequence.logprobs) == 5
        assert all(isinstance(t, int) for t in sequence.tokens) and all(lp < 0 for lp in sequence.logprobs)
        assert sequence.sequence_id
    assert len({s.sequence_id for s in response.sequences}) == 3
    assert response.prompt_logprobs is None and response.topk_prompt_logprobs is None
    assert response.prompt_cache_hit_tokens == 0


def test_integer_stops_end_with_stop_and_stop_strings_too(tinker: Any, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    free = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=8, seed=5)).result()
    tokens = free.sequences[0].tokens
    stopped = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=8, seed=5, stop=[tokens[2]])).result()
    assert stopped.sequences[0].stop_reason == "stop"
    assert stopped.sequences[0].tokens == tokens[:3]  # the stop token is kept, as vLLM keeps it
    text = ByteTokenizer().decode(tokens)
    letter = next((c for c in text[1:] if c.isalpha()), None)
    if letter is not None:
        by_text = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=8, seed=5, stop=letter)).result()
        assert by_text.sequences[0].stop_reason == "stop"


def test_empty_stop_means_only_max_tokens_stops(tinker: Any, service: Any) -> None:
    from lora_sampler.tinker import _convert

    ours, extra = _convert.sampling_params(tinker.SamplingParams(max_tokens=7, stop=[]))
    assert extra == {"ignore_eos": True} and ours.stop is None and ours.max_tokens == 7
    assert _convert.sampling_params(tinker.SamplingParams(stop=None))[1] is None
    assert _convert.sampling_params(tinker.SamplingParams(stop=[5, 6]))[0].stop_token_ids == (5, 6)
    client = service.create_sampling_client(base_model="tiny-base").result()
    response = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=7, stop=[])).result()
    assert response.sequences[0].stop_reason == "length" and len(response.sequences[0].tokens) == 7


def test_max_tokens_none_fills_the_context(tinker: Any, engine: FakeEngine, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    response = client.sample(prompt(tinker), 1, tinker.SamplingParams()).result()
    assert len(response.sequences[0].tokens) == engine.max_model_len - len(PROMPT)


def test_prompt_logprobs_equal_compute_logprobs(tinker: Any, service: Any, checkpoints: List[Path]) -> None:
    for model in ({"base_model": "tiny-base"}, {"model_path": str(checkpoints[0])}):
        client = service.create_sampling_client(**model).result()
        response = client.sample(
            prompt(tinker), 1, tinker.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3
        ).result()
        logprobs = client.compute_logprobs(prompt(tinker)).result()
        assert response.prompt_logprobs == logprobs
        assert logprobs[0] is None and len(logprobs) == len(PROMPT) and all(lp < 0 for lp in logprobs[1:])
        topk = response.topk_prompt_logprobs
        assert topk is not None and topk[0] is None and all(len(row) == 3 for row in topk[1:])
        assert asyncio.run(_awaited(client.compute_logprobs(prompt(tinker)))) == logprobs
        last = client.compute_logprobs(prompt(tinker), prompt_logprobs_last_n=2).result()
        assert last[:-2] == [None] * (len(PROMPT) - 2) and last[-2:] == logprobs[-2:]
    base = service.create_sampling_client(base_model="tiny-base").result().compute_logprobs(prompt(tinker)).result()
    assert base != logprobs  # the adapter's own


def test_topk_sample_logprobs(tinker: Any, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    response = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=4), topk_sample_logprobs=2).result()
    sequence = response.sequences[0]
    assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == 4
    for token, logprob, top in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs):
        assert len(top) == 2 and top[0][0] == token and top[0][1] == pytest.approx(logprob)


@pytest.mark.parametrize("argument, value", [("target_prompt_logprobs", "tensor"), ("prompt_alt_tokens_k", 2)])
def test_what_vllm_cannot_serve_raises_not_implemented_by_name(
    tinker: Any, service: Any, engine: FakeEngine, argument: str, value: Any
) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    with pytest.raises(NotImplementedError, match=argument):
        client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=1), **{argument: value})
    with pytest.raises(NotImplementedError, match="retry_config"):
        service.create_sampling_client(base_model="tiny-base", retry_config=object())
    assert engine.calls("/v1/completions") == 0


def test_bad_arguments_raise_before_any_request(tinker: Any, service: Any, engine: FakeEngine) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    with pytest.raises(TypeError, match=r"tinker\.ModelInput"):
        client.sample([1, 2], 1, tinker.SamplingParams())
    with pytest.raises(TypeError, match=r"tinker\.SamplingParams"):
        client.sample(prompt(tinker), 1, {"max_tokens": 3})
    with pytest.raises(ValueError, match="num_samples"):
        client.sample(prompt(tinker), 0, tinker.SamplingParams())
    with pytest.raises(ValueError, match="prompt_logprobs_last_n"):
        client.sample(prompt(tinker), 1, tinker.SamplingParams(), prompt_logprobs_last_n=2)
    with pytest.raises(ValueError, match="must not be empty"):
        client.compute_logprobs(tinker.ModelInput.empty())
    assert engine.calls("/v1/completions") == 0


def test_get_tokenizer_and_base_model(tinker: Any, engine: FakeEngine, lora_dir: Path, checkpoints: List[Path]) -> None:
    from lora_sampler.tinker import ServiceClient

    with ServiceClient(engine.url, lora_base_dir=lora_dir) as plain:
        client = plain.create_sampling_client(model_path=str(checkpoints[0])).result()
        assert client.get_base_model() == "tiny-base"
        assert asyncio.run(client.get_base_model_async()) == "tiny-base"
        with pytest.raises(RuntimeError, match="tokenizer=") as refused:
            client.get_tokenizer()
        assert "ByteTokenizer" in str(refused.value)
    tokenizer = ByteTokenizer()
    with ServiceClient(engine.url, lora_base_dir=lora_dir, tokenizer=tokenizer) as given:
        assert given.create_sampling_client(base_model="tiny-base").result().get_tokenizer() is tokenizer


def test_a_checkpoint_is_published_on_first_use_and_rides_the_race(
    tinker: Any, service: Any, engine: FakeEngine, checkpoints: List[Path], lora_dir: Path
) -> None:
    future = service.create_sampling_client(model_path=str(checkpoints[1]))
    assert list(lora_dir.iterdir()) == []  # nothing published yet
    client = future.result()
    name = service.sampler_client.resolve_adapter(str(checkpoints[1])).name
    engine.set_visibility_delay(name, requests=3)  # the engine lags behind the published folder
    futures = [client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=2)) for _ in range(8)]
    assert all(len(f.result(timeout=60).sequences[0].tokens) == 2 for f in futures)
    assert engine.calls("/v1/completions", name) >= 8


def test_an_outage_is_waited_out_with_max_outage(
    tinker: Any, make_engine: EngineFactory, lora_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine restarts once the client logged that it holds the request (not after a fixed time)."""
    from lora_sampler import RetryPolicy
    from lora_sampler.tinker import ServiceClient

    engine = make_engine()
    port = engine.port
    quick = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.1)
    with ServiceClient(engine.url, lora_base_dir=lora_dir, max_outage=30, retry=quick, timeout=(0.5, 5)) as service:
        client = service.create_sampling_client(base_model="tiny-base").result()
        engine.stop()
        future = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=2))
        wait_until(
            lambda: any("engine unreachable since" in r.getMessage() for r in list(caplog.records)),
            "the client holds the request",
        )
        assert not future.done()
        make_engine(port=port)
        assert len(future.result(timeout=60).sequences[0].tokens) == 2


def test_cancel_stops_a_request_not_started(tinker: Any, make_engine: EngineFactory, lora_dir: Path) -> None:
    from lora_sampler.tinker import ServiceClient

    engine = make_engine(latency=0.5)
    with ServiceClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as service:
        client = service.create_sampling_client(base_model="tiny-base").result()
        running = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=1))
        queued = client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=1))
        assert queued.cancel() and queued.cancelled()
        with pytest.raises(concurrent.futures.CancelledError):
            queued.result()
        assert running.result(timeout=30).sequences
    assert engine.calls("/v1/completions") == 1


def test_pickles_without_the_key_and_samples_in_a_spawned_process(
    tinker: Any, make_engine: EngineFactory, lora_dir: Path, checkpoints: List[Path], monkeypatch: Any
) -> None:
    from lora_sampler.tinker import ServiceClient

    key = "engine-key-" + os.urandom(8).hex()
    engine = make_engine(api_key=key)
    monkeypatch.setenv("TINKER_API_KEY", "never-sent-" + os.urandom(4).hex())
    monkeypatch.delenv("LORA_SAMPLER_API_KEY", raising=False)
    with ServiceClient(engine.url, api_key=key, lora_base_dir=lora_dir, tokenizer=ByteTokenizer()) as service:
        client = service.create_sampling_client(model_path=str(checkpoints[2])).result()
        expected = client.compute_logprobs(prompt(tinker)).result()
        blob = pickle.dumps(client)
        assert key.encode() not in blob and b"never-sent" not in blob
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:  # no key in the children
            refused = pool.submit(_score_in_child, client, PROMPT).result(timeout=120)
        assert "401" in refused  # TINKER_API_KEY is not read
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", key)
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
            answers = list(pool.map(_score_in_child, [client] * 4, [PROMPT] * 4, timeout=120))
    assert answers == [repr(expected)] * 4


def _score_in_child(client: Any, tokens: List[int]) -> str:
    import tinker

    try:
        return repr(client.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result(timeout=60))
    except Exception as error:  # the parent reads what happened
        return f"{type(error).__name__}: {error}"


def test_a_client_made_over_your_own_sampler_client(
    tinker: Any, engine: FakeEngine, lora_dir: Path, checkpoints: List[Path]
) -> None:
    """A copy keeps the client's options (here ``lora_base_dir``, which publishing the checkpoint needs)."""
    import requests

    from lora_sampler.tinker import SamplingClient

    with SamplerClient(engine.url, lora_base_dir=lora_dir) as own:
        client = SamplingClient(own, model_path=str(checkpoints[0]), tokenizer=ByteTokenizer())
        assert client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=2)).result().sequences
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            copy = pickle.loads(pickle.dumps(client))
        assert copy.compute_logprobs(prompt(tinker)).result() == client.compute_logprobs(prompt(tinker)).result()
    with SamplerClient(engine.url, session=requests.Session()) as own:
        with pytest.raises(TypeError, match="session="):
            pickle.dumps(SamplingClient(own, base_model="tiny-base"))
    with pytest.raises(TypeError, match="SamplerClient"):
        SamplingClient("http://127.0.0.1:1")  # type: ignore[arg-type]


def test_many_threads_share_one_client(tinker: Any, service: Any) -> None:
    client = service.create_sampling_client(base_model="tiny-base").result()
    results: List[Any] = []

    def work() -> None:
        results.append(client.compute_logprobs(prompt(tinker)).result(timeout=60))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 8 and all(r == results[0] for r in results)


@contextlib.contextmanager
def _python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler, as a user's script has it, for the block: in a full run an earlier test's imports
    (the cookbook's stack) may leave another SIGINT handler installed, which swallowed the signal."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_waiting_cancels_the_requests(tinker: Any, make_engine: EngineFactory, lora_dir: Path) -> None:
    import signal

    from lora_sampler.tinker import ServiceClient

    engine = make_engine(latency=10.0)
    with _python_ctrl_c(), ServiceClient(engine.url, lora_base_dir=lora_dir, max_workers=2) as service:
        client = service.create_sampling_client(base_model="tiny-base").result()
        futures = [client.sample(prompt(tinker), 1, tinker.SamplingParams(max_tokens=1)) for _ in range(4)]
        main, failures = threading.main_thread(), []

        def interrupt_once_waiting() -> None:  # SIGINT once the main thread waits in result(), not after a time
            try:
                wait_until(lambda: blocked_in(main, type(futures[0]).result), "the main thread waits in result()")
            except AssertionError as error:  # reported after the block
                failures.append(error)
            signal.pthread_kill(main.ident or 0, signal.SIGINT)  # sent even so: the block ends

        interrupter = threading.Thread(target=interrupt_once_waiting, daemon=True)
        interrupter.start()
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            futures[0].result(timeout=30)
        done, _ = concurrent.futures.wait(futures, timeout=5)
        assert len(done) == 4 and time.monotonic() - began < 6  # nothing waited for the 10 s answers
        assert all(f.cancelled() or f.exception() is not None for f in futures)
        interrupter.join(5)
        assert not failures, failures


def test_repr_names_the_model_and_the_engine(tinker: Any, service: Any, engine: FakeEngine) -> None:
    base = service.create_sampling_client(base_model="tiny-base").result()
    assert repr(base) == f"lora_sampler.tinker.SamplingClient(base_model='tiny-base', base_url={engine.url!r})"
    adapter = service.create_sampling_client(model_path="runs/step-100").result()
    assert "model_path='runs/step-100'" in repr(adapter)
