"""A client's life across processes: inherited by a forked child, pickled to a worker, or built on a user's session.

Every child process here is bounded: it is joined for at most ``CHILD_SECONDS`` and killed if still running, so a
hang fails the test instead of stalling it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from typing import Any, Callable, List

import pytest
import requests

from lora_sampler import SamplerClient, SampleRequest
from lora_sampler.testing import FakeEngine

#: Seconds a child may take for a few requests to a loopback engine; far more than it needs.
CHILD_SECONDS = 30.0

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork-started processes are a Linux default")


def in_forked_child(work: Callable[[], Any]) -> Any:
    """Run ``work`` in a fork-started child (multiprocessing's Linux default before 3.14); return what it returned.

    The child inherits this process's memory, the client included. A child still running after ``CHILD_SECONDS`` is
    killed and the test fails, naming the hang.
    """
    context = multiprocessing.get_context("fork")
    results: Any = context.SimpleQueue()

    def child() -> None:
        try:
            results.put(("ok", work()))
        except BaseException as exc:  # report anything, the child must not hang or vanish silently
            results.put(("error", f"{type(exc).__name__}: {exc}"))

    process = context.Process(target=child, daemon=True)
    process.start()
    process.join(CHILD_SECONDS)
    if process.is_alive():
        process.kill()
        process.join(5)
        pytest.fail(f"the forked child was still running after {CHILD_SECONDS:g} s (it hung)")
    assert not results.empty(), f"the child exited with code {process.exitcode} and reported nothing"
    return results.get()


def request(engine: FakeEngine, text: str = "hello") -> SampleRequest:
    return SampleRequest(text, base_model=engine.model)


def test_lifecycle_sample_many_in_a_forked_child_works(engine: FakeEngine) -> None:
    """A client that ran sample_many, inherited by a fork-started child, runs sample_many there too (it hung)."""
    with SamplerClient(engine.url, max_workers=4) as client:
        assert len(client.sample_many([request(engine)] * 8)) == 8  # the parent's threads and connections exist
        status, value = in_forked_child(lambda: len(client.sample_many([request(engine)] * 8)))
        assert (status, value) == ("ok", 8)
        assert len(client.sample_many([request(engine)] * 8)) == 8  # the parent's client is untouched


def test_lifecycle_forked_child_does_not_use_the_parents_connections(engine: FakeEngine) -> None:
    """The child opens connections of its own: the parent's kept-alive sockets are never read by two processes."""
    with SamplerClient(engine.url, max_workers=2) as client:
        client.sample_many([request(engine)] * 4)
        before = engine.connections_opened
        status, value = in_forked_child(lambda: len(client.sample_many([request(engine, f"p{i}") for i in range(6)])))
        assert (status, value) == ("ok", 6)
        assert engine.connections_opened > before


def test_lifecycle_sample_in_a_forked_child_works(engine: FakeEngine) -> None:
    """A single sample() in the child works (it did before too), and so does a submit future."""
    with SamplerClient(engine.url, max_workers=2) as client:
        client.sample("warm", base_model=engine.model, max_tokens=1)
        status, value = in_forked_child(
            lambda: (
                bool(client.sample("x", base_model=engine.model, max_tokens=2).sequences),
                bool(client.submit("y", base_model=engine.model, max_tokens=2).result(CHILD_SECONDS).sequences),
            )
        )
        assert (status, value) == ("ok", (True, True))


def test_lifecycle_user_session_client_fails_at_once_in_a_forked_child(engine: FakeEngine) -> None:
    """With session=, the child is refused at once with an error naming the fix, never a hang."""
    with requests.Session() as session, SamplerClient(engine.url, session=session) as client:
        client.sample("warm", base_model=engine.model, max_tokens=1)
        status, value = in_forked_child(lambda: client.sample("x", base_model=engine.model, max_tokens=1))
        assert status == "error"
        assert "RuntimeError" in value and "session=" in value and "spawn" in value
        rows = [request(engine)] * 5
        status, value = in_forked_child(lambda: client.sample_many(rows, return_exceptions=True))
        assert status == "error" and "RuntimeError" in value  # raised once, not one error row per request


def test_lifecycle_user_session_submits_fail_at_once_in_a_forked_child(engine: FakeEngine) -> None:
    """Every submit spelling refuses the child at once, as ``submit`` does: ``submit_logprobs`` handed back a future
    that failed only when waited on."""
    with requests.Session() as session, SamplerClient(engine.url, session=session) as client:
        client.sample("warm", base_model=engine.model, max_tokens=1)
        for submit in (
            lambda: client.submit("x", base_model=engine.model, max_tokens=1),
            lambda: client.submit_logprobs([1, 2, 3], base_model=engine.model),
        ):
            status, value = in_forked_child(lambda submit=submit: type(submit()).__name__)
            assert status == "error" and "RuntimeError" in value and "session=" in value


def test_lifecycle_pickled_client_has_no_key_and_reads_it_in_its_process(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickled client carries its options but not the API key nor the URL's password; unpickled, it works."""
    with SamplerClient(
        engine.url.replace("http://", "http://user:pa55word@"),
        api_key="sk-never-pickled",
        timeout=(3, 7),
        max_workers=3,
    ) as client:
        data = pickle.dumps(client)
    assert b"sk-never-pickled" not in data and b"pa55word" not in data
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", "sk-from-env")
    with pickle.loads(data) as copy:
        assert copy.has_api_key and copy.max_workers == 3 and copy.base_url == engine.url
        assert copy.sample("x", base_model=engine.model, max_tokens=1).sequences


def test_lifecycle_pickled_client_carries_no_replica_password() -> None:
    """A replica URL's password is no more pickled than the base URL's: the copy has each replica without it."""
    replicas = ["http://user:r3plica-pw@127.0.0.1:9", "http://127.0.0.2:9"]
    with SamplerClient("http://127.0.0.1:9", replicas=replicas) as client:
        data = pickle.dumps(client)
    assert b"r3plica-pw" not in data
    with pickle.loads(data) as copy:
        assert copy.replicas() == ("http://127.0.0.1:9", "http://127.0.0.2:9")


def test_lifecycle_pickled_client_works_in_a_spawned_worker(engine: FakeEngine) -> None:
    """multiprocessing's spawn start method (pickling the client into the worker) gets a working client."""
    context = multiprocessing.get_context("spawn")
    with SamplerClient(engine.url, max_workers=2) as client, context.Pool(1) as pool:
        outcome = pool.apply_async(_texts_in_worker, (client, engine.model))
        assert len(outcome.get(CHILD_SECONDS)) == 3


def _texts_in_worker(client: SamplerClient, model: str) -> List[str]:
    with client:
        return [output.sequences[0].text for output in client.sample_many([SampleRequest("x", base_model=model)] * 3)]


def test_lifecycle_client_with_a_user_session_cannot_be_pickled() -> None:
    """A client on a user's session refuses pickling with a TypeError naming what to do."""
    with requests.Session() as session, SamplerClient("http://127.0.0.1:9", session=session) as client:
        with pytest.raises(TypeError, match="session="):
            pickle.dumps(client)


def test_lifecycle_process_ids_are_distinct_in_the_child(engine: FakeEngine) -> None:
    """Sanity of the harness: the work really ran in another process."""
    status, value = in_forked_child(os.getpid)
    assert status == "ok" and value != os.getpid()
