"""The adapter registry's publish-once map under concurrent unloads, and the keyed-lock helper it uses."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List

import pytest

from lora_sampler._adapters import publish as publish_module
from lora_sampler._adapters.registry import AdapterRegistry
from lora_sampler._locks import KeyedLocks
from lora_sampler.types import Adapter


class _Transport:
    """Answers every unload with 200, and ``GET /v1/models`` with one base model."""

    timeout = (1.0, 1.0)

    def post_adapter_command(self, *args: Any) -> str:
        return ""

    def get_json(self, path: str, *, parse: Any) -> Any:
        return parse({"data": [{"id": "base", "root": "base"}]})


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond, so a race window of a few bytecodes is hit within the test."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def recording(errors: List[BaseException], work: Callable[..., None]) -> Callable[..., None]:
    """``work`` as a thread target that keeps what it raised in ``errors`` (a thread's exception is lost otherwise)."""

    def run(*args: Any) -> None:
        try:
            work(*args)
        except BaseException as exc:  # pragma: no cover - reported by the test
            errors.append(exc)

    return run


def run_until_done(workers: List[threading.Thread], background: List[threading.Thread], stop: threading.Event) -> None:
    """Start all threads; once ``workers`` are done, stop and join ``background``."""
    for thread in background + workers:
        thread.start()
    for thread in workers:
        thread.join()
    stop.set()
    for thread in background:
        thread.join()


@pytest.mark.usefixtures("fast_switching")
def test_registry_publish_once_survives_concurrent_unloads(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Checkpoints resolved by many threads while others unload another adapter: each publishes once, unloads work."""
    published: Dict[str, int] = {}
    count_lock = threading.Lock()

    def fake_publish(checkpoint: Any, lora_base_dir: Any, **kwargs: Any) -> Adapter:
        key = str(checkpoint)
        with count_lock:
            published[key] = published.get(key, 0) + 1
        return Adapter(f"adapter-{len(key)}-{abs(hash(key)) % 10**9}", path=str(tmp_path))

    def slow_check(path: Any, model: str) -> None:
        time.sleep(0)  # the preflight reads a file: other threads run meanwhile

    monkeypatch.setattr(publish_module, "publish_checkpoint", fake_publish)
    monkeypatch.setattr(publish_module, "check_adapter_config", slow_check)
    registry = AdapterRegistry(_Transport(), tmp_path, None)  # type: ignore[arg-type]
    checkpoints = [f"{tmp_path}/ckpt-{i}.tar.gz" for i in range(400)]
    stop = threading.Event()
    errors: List[BaseException] = []

    def resolver(offset: int) -> None:
        for _ in range(3):
            for checkpoint in checkpoints[offset:] + checkpoints[:offset]:
                registry.resolve(checkpoint)

    def unloader() -> None:
        while not stop.is_set():
            registry.unload("unrelated")

    resolvers = [threading.Thread(target=recording(errors, resolver), args=(i * 50,)) for i in range(8)]
    unloaders = [threading.Thread(target=recording(errors, unloader)) for _ in range(4)]
    run_until_done(resolvers, unloaders, stop)
    assert not errors
    republished = {key: n for key, n in published.items() if n != 1}
    assert len(published) == len(checkpoints) and not republished


def test_keyed_locks_forget_idle_keys() -> None:
    """A key's lock is dropped once nobody holds or waits for it, also after an exception and a reentrant hold."""
    locks = KeyedLocks()
    for key in range(1000):
        with locks.hold(key):
            with locks.hold(key):  # reentrant: the same thread again
                assert len(locks) == 1
    with pytest.raises(RuntimeError):
        with locks.hold("failing"):
            raise RuntimeError("boom")
    assert len(locks) == 0


def test_keyed_locks_serialise_one_key_and_keep_waiters() -> None:
    """Threads on one key run one at a time; the key is kept while a waiter queues, and dropped after."""
    locks = KeyedLocks()
    inside = threading.Event()
    release = threading.Event()
    order: List[str] = []

    def first() -> None:
        with locks.hold("k"):
            inside.set()
            release.wait(10)
            order.append("first")

    def second() -> None:
        inside.wait(10)
        with locks.hold("k"):
            order.append("second")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(10)
    with locks.hold("other"):  # another key is free meanwhile
        assert len(locks) == 2
    release.set()
    for thread in threads:
        thread.join()
    assert order == ["first", "second"] and len(locks) == 0


@pytest.mark.parametrize("resume_in_release", [False, True], ids=["after-the-unload", "inside-the-lease-release"])
def test_registry_forgets_a_resolution_its_adapter_was_unloaded_during(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, resume_in_release: bool
) -> None:
    """A checkpoint's first resolve, paused in its preflight after the publish, while another thread unloads the
    adapter (deleting its files, say): the unload wins, and the next resolve publishes the checkpoint again instead of
    handing out the record of a folder that was let go of (it kept it for the client's life). The paused resolve
    goes on after the unload, or while the unload lets go of the lease (it then sees the lease still held)."""
    published: List[str] = []
    in_preflight, go_on = threading.Event(), threading.Event()
    (tmp_path / "step-5-0123456789ab").mkdir()

    def fake_publish(checkpoint: Any, lora_base_dir: Any, **kwargs: Any) -> Adapter:
        published.append(str(checkpoint))
        return Adapter("step-5-0123456789ab", path=str(tmp_path / "step-5-0123456789ab"))

    def paused_check(path: Any, model: str) -> None:
        if len(published) == 1:
            in_preflight.set()
            assert go_on.wait(30), "the test never let the preflight go on"

    monkeypatch.setattr(publish_module, "publish_checkpoint", fake_publish)
    monkeypatch.setattr(publish_module, "check_adapter_config", paused_check)
    registry = AdapterRegistry(_Transport(), tmp_path, None)  # type: ignore[arg-type]
    checkpoint = str(tmp_path / "step-5.tar.gz")
    errors: List[BaseException] = []
    first = threading.Thread(target=recording(errors, registry.resolve), args=(checkpoint,))
    let_go = registry.release_lease

    def release_after_the_resolve_recorded(name: str) -> None:
        go_on.set()  # the paused resolve finishes (and records, if it still sees the lease) before the lease goes
        first.join(30)
        let_go(name)

    if resume_in_release:
        monkeypatch.setattr(registry, "release_lease", release_after_the_resolve_recorded)
    first.start()
    try:
        assert in_preflight.wait(30), "the first resolve never reached its preflight"
        registry.unload("step-5-0123456789ab")
    finally:
        go_on.set()
        first.join(30)
    assert not first.is_alive() and not errors
    registry.resolve(checkpoint)
    assert published == [checkpoint, checkpoint]


def test_threads_meeting_on_an_adapters_first_use_ask_the_engine_its_model_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The preflight is not serialised, but the engine's model it checks against is read by one thread: another that
    needs it meanwhile waits for that answer instead of sending its own ``GET /v1/models`` (one per worker)."""
    asked: List[str] = []
    others: List[threading.Thread] = []
    adapter = Adapter("a", path=str(tmp_path))

    class Counting(_Transport):
        def get_json(self, path: str, *, parse: Any) -> Any:
            asked.append(path)
            if len(asked) == 1:  # while the first read is in flight, another thread meets the adapter
                others.append(threading.Thread(target=recording(errors, registry.resolve), args=(adapter,)))
                others[0].start()
                others[0].join(0.5)  # it asks the engine too, or waits for this answer (then this join times out)
            return super().get_json(path, parse=parse)

    monkeypatch.setattr(publish_module, "check_adapter_config", lambda path, model: None)
    registry = AdapterRegistry(Counting(), tmp_path, None)  # type: ignore[arg-type]
    errors: List[BaseException] = []
    registry.resolve(adapter)
    others[0].join(30)
    assert not others[0].is_alive() and not errors
    assert asked == ["/v1/models"]
