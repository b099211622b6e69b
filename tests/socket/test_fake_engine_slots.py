"""FakeEngine's adapter slots (``lora_slots``, ``swap_latency``): how vLLM's ``--max-loras`` batches adapters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, List

import pytest
import requests

from lora_sampler.testing import FakeEngine, write_adapter

EngineFactory = Callable[..., FakeEngine]


def complete(engine: FakeEngine, model: str) -> int:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
    return requests.post(engine.url + "/v1/completions", json=body, timeout=30).status_code


def runs_in_finish_order(engine: FakeEngine) -> int:
    """How many runs of one adapter the completions form in the order they finished."""
    models = [r.model for r in sorted(engine.requests, key=lambda r: r.finished) if r.path == "/v1/completions"]
    return sum(1 for index, model in enumerate(models) if index == 0 or models[index - 1] != model)


@pytest.fixture
def adapters(lora_dir: Path) -> List[str]:
    for name in ("a", "b"):
        write_adapter(lora_dir / name, "tiny-base")
    return ["a", "b"]


def test_fake_engine_one_slot_serves_one_adapter_at_a_time(make_engine: EngineFactory, adapters: List[str]) -> None:
    """With one slot, interleaved requests of two adapters never run together, and each change is a swap."""
    engine = make_engine(latency=0.01, lora_slots=1, swap_latency=0.02)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda n: complete(engine, adapters[n % 2]), range(40)))
    assert statuses == [200] * 40
    assert 2 <= engine.adapter_swaps <= 40
    # one adapter at a time: every change of adapter between answers needed a swap
    assert runs_in_finish_order(engine) <= engine.adapter_swaps
    names = [name for _, name in engine.swap_log]
    assert len(names) == engine.adapter_swaps and all(x != y for x, y in zip(names, names[1:]))


def test_fake_engine_requests_of_one_adapter_share_its_slot(make_engine: EngineFactory, adapters: List[str]) -> None:
    """Concurrent requests of one adapter swap it in once; the base model needs no slot."""
    engine = make_engine(latency=0.01, lora_slots=1, swap_latency=0.02)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda n: complete(engine, "a"), range(16)))
    assert statuses == [200] * 16 and engine.adapter_swaps == 1
    assert complete(engine, "tiny-base") == 200 and engine.adapter_swaps == 1
    assert engine.slotted_adapters == ["a"]


def test_fake_engine_two_slots_hold_two_adapters(make_engine: EngineFactory, adapters: List[str]) -> None:
    """With two slots, two adapters run side by side after one swap each."""
    engine = make_engine(latency=0.01, lora_slots=2, swap_latency=0.02)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda n: complete(engine, adapters[n % 2]), range(40)))
    assert statuses == [200] * 40 and engine.adapter_swaps == 2
    assert runs_in_finish_order(engine) > 2  # answers of both adapters interleave: they run side by side


def test_fake_engine_rejects_zero_slots(lora_dir: Path) -> Any:
    """lora_slots must be at least 1 (None: no limit)."""
    with pytest.raises(ValueError, match="lora_slots"):
        FakeEngine(lora_dir=lora_dir, lora_slots=0)
