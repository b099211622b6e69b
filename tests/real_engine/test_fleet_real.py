"""Two real vLLM replicas WITHOUT the resolver plugin behind a real vllm-router: ``replicas="router"`` end to end.

Without the resolver a replica serves an adapter only once it was loaded on it, and a restarted replica has
forgotten every adapter. The module starts its own two engines (about 2.7 GB each; they run before the suite's shared
engine starts, see conftest) and one router, once, and stops them all when the module ends. Run under
``flock /tmp/lora_sampler_vllm.lock tox -e vllm`` (two engines is the machine-wide maximum).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import secrets
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List

import pytest

from lora_sampler import SampleOutput, SamplerClient, SamplingParams

if TYPE_CHECKING:
    from conftest import RealEngine

#: conftest runs this module before the shared engine starts; its own two engines stop when the module ends.
RUNS_BEFORE_SHARED_ENGINE = True
ROUTER_HELPERS = Path(__file__).resolve().parent.parent / "router" / "_fleet.py"


def _router_module() -> ModuleType:
    """Import tests/router/_fleet.py (the vllm-router process helper) by path."""
    name = "lora_sampler_tests_router_fleet"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROUTER_HELPERS)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def fleet(
    start_replica: Callable[..., RealEngine], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dict[str, Any]]:
    """Two resolver-less engines sharing one API key, a vllm-router over them, and the shared adapter folder."""
    key = f"fleet-{secrets.token_hex(8)}"
    workdirs = [tmp_path_factory.mktemp(f"vllm-replica-{i}") for i in range(2)]
    engines: List[RealEngine] = []
    router = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once: ~30 s instead of ~60 s
            futures = [pool.submit(start_replica, w, resolver=False, api_key=key) for w in workdirs]
            for future in futures:
                if future.exception() is None:
                    engines.append(future.result())
            for future in futures:
                future.result()  # re-raise a failed start (after keeping the started one for the teardown)
        router = _router_module().Router([engine.url for engine in engines])
        folder = tmp_path_factory.mktemp("fleet-loras")
        yield {
            "engines": engines,
            "workdirs": workdirs,
            "router": router,
            "key": key,
            "folder": folder,
        }
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def _lists(engine: RealEngine, name: str) -> bool:
    cards = engine.session.get(f"{engine.url}/v1/models", headers=engine.headers(), timeout=30).json()["data"]
    return any(card["id"] == name and card.get("parent") for card in cards)


def _sample(client: SamplerClient, adapter: Any, count: int) -> List[Any]:
    """``count`` requests of one prompt each: each has its own session id, which the router hashes, so they reach
    both replicas (batched, the prompts made one to four requests, which could all land on one replica)."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    rows = [{"prompt": [1, 2, 3 + i], "adapter": adapter, "sampling_params": params} for i in range(count)]
    return client.sample_many(rows, return_exceptions=True, prompts_per_request=1)


def test_fleet_real_publish_sample_restart_sample_unload_delete(
    fleet: Dict[str, Any], start_replica: Callable[..., RealEngine], vllm_env: Any
) -> None:
    """No request fails through a replica restart; unload reaches both replicas before the folder goes."""
    engines: List[RealEngine] = fleet["engines"]
    router = fleet["router"]
    with SamplerClient(
        router.url, api_key=fleet["key"], lora_base_dir=fleet["folder"], replicas="router", timeout=(10.0, 120.0)
    ) as client:
        assert sorted(client.replicas()) == sorted(e.url for e in engines)
        adapter = client.publish(vllm_env.adapter_dirs[0])
        assert all(_lists(engine, adapter.name) for engine in engines)  # loaded on both on return
        first = _sample(client, adapter, 16)
        assert [r for r in first if not isinstance(r, SampleOutput)] == []

        port = int(engines[1].url.rsplit(":", 1)[1])
        engines[1].stop()
        engines[1] = start_replica(fleet["workdirs"][1], resolver=False, api_key=fleet["key"], port=port)
        assert not _lists(engines[1], adapter.name)  # a restarted replica has forgotten every adapter
        router.wait_healthy(timeout=60.0)
        again = _sample(client, adapter, 32)
        assert [r for r in again if not isinstance(r, SampleOutput)] == []
        assert _lists(engines[1], adapter.name)  # the race reconciled the restarted replica

        assert adapter.path is not None
        client.unload(adapter, delete_files=True)
        assert not Path(adapter.path).exists()
        assert not any(_lists(engine, adapter.name) for engine in engines)
        base = client.sample(
            [1, 2, 3], base_model=client.served_base_models()[0], sampling_params=SamplingParams(max_tokens=2)
        )
        assert base.sequences
    assert all(engine.process.poll() is None for engine in engines)  # the engines stayed up
