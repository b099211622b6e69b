"""``SamplerClient`` against the real vLLM engine: the adapter-load race and the errors that must not be retried.

Every scenario uses a fresh adapter name (the engine never forgets a resolved name). Adapter directories are
never deleted while the engine runs, except by ``client.unload(delete_files=True)``, which unloads
first; the unload-then-delete test checks exactly that the engine survives it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest
import requests

from lora_sampler import (
    AdapterNotReadyError,
    EngineStatusError,
    ModelNotFoundError,
    RetryEvent,
    RetryPolicy,
    SampleOutput,
    SamplerClient,
    SampleRequest,
    SamplingParams,
)
from lora_sampler.testing import FakeEngine, write_adapter

if TYPE_CHECKING:
    from conftest import EngineRestarter, RealEngine

#: Short completions keep the engine work per request tiny.
PARAMS = SamplingParams(max_tokens=4)
#: Seconds a background writer waits before it completes a publication.
LAG = 1.0


@pytest.fixture()
def retries() -> list[RetryEvent]:
    """Collects the client's retry events (the ``on_retry`` hook)."""
    return []


@pytest.fixture()
def client(vllm_engine: RealEngine, retries: list[RetryEvent]) -> Iterator[SamplerClient]:
    """A client for the real engine whose retries land in ``retries``."""
    policy = RetryPolicy(on_retry=retries.append)
    with SamplerClient(
        vllm_engine.url, api_key=vllm_engine.api_key, lora_base_dir=vllm_engine.lora_dir, retry=policy, max_workers=32
    ) as sampler:
        yield sampler


def _later(delay: float, action: Callable[[], object]) -> threading.Thread:
    """Run ``action()`` on a thread after ``delay`` seconds; the caller joins it."""

    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_sampled(output: SampleOutput, tokens: int = 4) -> None:
    """Assert one sequence of ``tokens`` tokens with a logprob each."""
    assert isinstance(output, SampleOutput)
    assert len(output.sequences) == 1
    sequence = output.sequences[0]
    assert len(sequence.tokens) == tokens
    assert len(sequence.logprobs) == tokens


def test_published_adapter_samples_on_the_first_call(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent], adapter_name: str
) -> None:
    if hasattr(client, "publish"):
        adapter = client.publish(vllm_engine.adapter_dir, name=adapter_name)
        assert adapter.name == adapter_name
    else:  # pragma: no cover - before the client grew publish()
        vllm_engine.publish(adapter_name)
    _assert_sampled(client.sample([1, 2, 3], adapter=adapter_name, sampling_params=PARAMS))
    assert retries == []


def test_archive_path_is_published_on_first_use(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent]
) -> None:
    output = client.sample([1, 2, 3], adapter=vllm_engine.adapter_archive, sampling_params=PARAMS)
    _assert_sampled(output)
    assert retries == []
    assert output.model in os.listdir(vllm_engine.lora_dir)


def test_visibility_lag_self_heals(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent], adapter_name: str
) -> None:
    staging = vllm_engine.lora_dir / f".staging-{adapter_name}"
    shutil.copytree(vllm_engine.adapter_dir, staging)
    writer = _later(LAG, lambda: os.rename(staging, vllm_engine.lora_dir / adapter_name))
    started = time.monotonic()
    try:
        output = client.sample([1, 2, 3], adapter=adapter_name, sampling_params=PARAMS)
    finally:
        writer.join()
    _assert_sampled(output)
    assert time.monotonic() - started >= LAG
    assert retries, "the adapter was not visible for 1 s, so the client must have retried"
    assert all(isinstance(event.cause, ModelNotFoundError) for event in retries), retries


def test_non_atomic_publication_self_heals_through_400s(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent], adapter_name: str
) -> None:
    target = vllm_engine.lora_dir / adapter_name
    target.mkdir()
    shutil.copy2(vllm_engine.adapter_dir / "adapter_config.json", target / "adapter_config.json")
    weights = (vllm_engine.adapter_dir / "adapter_model.safetensors").read_bytes()
    writer = _later(LAG, lambda: (target / "adapter_model.safetensors").write_bytes(weights))
    try:
        output = client.sample([1, 2, 3], adapter=adapter_name, sampling_params=PARAMS)
    finally:
        writer.join()
    _assert_sampled(output)
    assert retries, "the weights arrived 1 s late, so the client must have retried"
    assert any(isinstance(event.cause, AdapterNotReadyError) for event in retries), retries
    assert vllm_engine.complete(vllm_engine.model).status_code == 200  # the engine is still healthy


def test_base_model_typo_raises_after_one_attempt(client: SamplerClient, retries: list[RetryEvent]) -> None:
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError) as caught:
        client.sample([1, 2, 3], base_model="typo", sampling_params=PARAMS)
    error = caught.value
    assert error.attempts == 1
    assert error.status == 404
    assert isinstance(error, requests.HTTPError)
    assert "does not exist" in error.engine_message
    assert retries == []
    assert time.monotonic() - started < 2.0


def test_over_length_prompt_raises_at_once(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent], adapter_name: str
) -> None:
    vllm_engine.publish(adapter_name)
    for target in ({"base_model": vllm_engine.model}, {"adapter": adapter_name}):
        with pytest.raises(EngineStatusError) as caught:
            client.sample([5] * 300, sampling_params=PARAMS, **target)  # type: ignore[arg-type]
        error = caught.value
        assert not isinstance(error, (ModelNotFoundError, AdapterNotReadyError)), target
        assert (error.status, error.attempts) == (400, 1), target
        assert "maximum context length is 256 tokens" in error.engine_message, target
    assert retries == []


def test_32_concurrent_first_requests_all_succeed(
    vllm_engine: RealEngine, client: SamplerClient, adapter_name: str
) -> None:
    if hasattr(client, "publish"):
        client.publish(vllm_engine.adapter_dirs[1], name=adapter_name)
    else:  # pragma: no cover - before the client grew publish()
        vllm_engine.publish(adapter_name, vllm_engine.adapter_dirs[1])
    batch = [SampleRequest([1, 2, 3 + i], adapter=adapter_name, sampling_params=PARAMS) for i in range(32)]
    outputs = client.sample_many(batch)
    assert len(outputs) == 32
    for output in outputs:
        _assert_sampled(output)


def test_32_concurrent_first_requests_through_the_race(
    vllm_engine: RealEngine, client: SamplerClient, retries: list[RetryEvent], adapter_name: str
) -> None:
    staging = vllm_engine.lora_dir / f".staging-{adapter_name}"
    shutil.copytree(vllm_engine.adapter_dirs[1], staging)
    writer = _later(0.5, lambda: os.rename(staging, vllm_engine.lora_dir / adapter_name))
    batch = [SampleRequest([1, 2, 3 + i], adapter=adapter_name, sampling_params=PARAMS) for i in range(32)]
    try:
        outputs = client.sample_many(batch, return_exceptions=True)
    finally:
        writer.join()
    failures = [output for output in outputs if not isinstance(output, SampleOutput)]
    assert failures == []
    assert retries  # they did race


def _unload_then_delete(url: str, api_key: str, model: str, lora_dir: Path, source: Path, names: list[str]) -> None:
    """Run the engine-killing sequence (delete, evict, reload) through the client,, which must keep the engine healthy.

    Publish and sample ``names[0]``, ``unload(delete_files=True)`` it, sample every other name (more than
    ``--max-loras`` 4, so a still-registered ``names[0]`` would be evicted and reloaded from its deleted folder),
    then ask for ``names[0]`` again: a 404 the client retries and gives up on, never the engine's death.
    """
    giveups: list[RetryEvent] = []
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, on_giveup=giveups.append)
    first, others = names[0], names[1:]
    assert len(others) > 4
    with SamplerClient(url, api_key=api_key, lora_base_dir=lora_dir, retry=policy) as client:
        adapter = client.publish(source, name=first)
        _assert_sampled(client.sample([1, 2, 3], adapter=first, sampling_params=PARAMS))
        client.unload(adapter, delete_files=True)
        assert not (lora_dir / first).exists()
        for name in others:
            client.publish(source, name=name)
            _assert_sampled(client.sample([1, 2, 3], adapter=name, sampling_params=PARAMS))

        with pytest.raises(ModelNotFoundError) as caught:
            client.sample([1, 2, 3], adapter=first, sampling_params=PARAMS)
        assert (caught.value.status, caught.value.attempts) == (404, 3)
        assert len(giveups) == 1

        models = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
        assert models.status_code == 200
        listed = {card["id"] for card in models.json()["data"]}
        assert model in listed and first not in listed
        assert set(others) <= listed
        _assert_sampled(client.sample([1, 2, 3], base_model=model, sampling_params=PARAMS))


def test_unload_then_delete_leaves_the_engine_healthy(vllm_engine: RealEngine, adapter_name: str) -> None:
    """client.unload(delete_files=True) never reaches the engine-killing sequence on the real engine."""
    names = [adapter_name] + [vllm_engine.fresh_name("after-unload") for _ in range(5)]
    _unload_then_delete(
        vllm_engine.url, vllm_engine.api_key, vllm_engine.model, vllm_engine.lora_dir, vllm_engine.adapter_dir, names
    )
    assert vllm_engine.process.poll() is None
    assert "EngineDeadError" not in vllm_engine.log_text()


def test_unload_then_delete_leaves_the_fake_engine_healthy(tmp_path: Path) -> None:
    """The FakeEngine twin: the same sequence leaves the fake (which dies like vLLM) alive."""
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    source = Path(write_adapter(tmp_path / "source", "tiny-base"))
    names = ["e1"] + [f"other-{index}" for index in range(5)]
    with FakeEngine(model="tiny-base", lora_dir=lora_dir, api_key="fake-key", max_loras=4) as engine:
        _unload_then_delete(engine.url, "fake-key", engine.model, lora_dir, source, names)
        assert not engine.is_dead
        assert "e1" not in engine.loaded_adapters


@pytest.mark.restarts_engine
def test_engine_killed_mid_batch_and_restarted_answers_every_row(
    vllm_engine: RealEngine, engine_restarter: EngineRestarter
) -> None:
    """SIGKILL the engine a third into a batch and start it again (~25-30 s): with ``max_outage`` every row is
    answered, through the adapter race on the restarted engine that forgot the adapter."""
    restarts: list[threading.Thread] = []
    took: list[float] = []
    events: list[object] = []

    def rows() -> Iterator[SampleRequest]:
        for i in range(48):
            if i == 16:  # sample_many pulls rows lazily: requests are in flight right now
                engine_restarter.kill()
                restarts.append(_later(0.0, lambda: took.append(engine_restarter.restart())))
            yield SampleRequest([1, 2, 3 + i], adapter=vllm_engine.adapter_archive, sampling_params=PARAMS)

    policy = RetryPolicy(base_delay=0.05, max_delay=0.5)
    with SamplerClient(
        vllm_engine.url, api_key=vllm_engine.api_key, lora_base_dir=vllm_engine.lora_dir, retry=policy, max_workers=4
    ) as client:
        started = time.monotonic()
        results = client.sample_many(rows(), return_exceptions=True, max_outage=240, on_outage=events.append)
        wall = time.monotonic() - started
    for thread in restarts:
        thread.join(300)
    failed = [r for r in results if not isinstance(r, SampleOutput)]
    assert len(results) == 48 and failed == [], failed[:3]
    for output in results:
        _assert_sampled(output)
    kinds = [getattr(e, "kind", None) for e in events]
    assert took and "held" in kinds and "back" in kinds, (took, kinds)
    print(f"restart took {took[0]:.1f} s; batch of 48 across it took {wall:.1f} s")
