"""Shared fixtures: the retry testing switch off at the start and end of every test, the resolver folder, and running
FakeEngines reading it, always stopped afterwards.

A module that needs engine options overrides ``engine_options`` (e.g. ``{"max_loras": 2}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

from lora_sampler import retry
from lora_sampler.testing import FakeEngine

EngineFactory = Callable[..., FakeEngine]


@pytest.fixture(autouse=True)
def _reset_testing_switch() -> Iterator[None]:
    retry.set_testing(False)
    yield
    retry.set_testing(False)


@pytest.fixture
def no_waits() -> Iterator[None]:
    """Retry waits are 0 s for this test (attempts are kept)."""
    with retry.set_testing(True):
        yield


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    """The engine's resolver folder (``tmp_path / "loras"``)."""
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder


@pytest.fixture
def make_engine(lora_dir: Path) -> Iterator[EngineFactory]:
    """Start FakeEngines reading ``lora_dir`` unless told otherwise; every one is stopped after the test."""
    engines: List[FakeEngine] = []

    def make(**kwargs: Any) -> FakeEngine:
        kwargs.setdefault("lora_dir", lora_dir)
        engine = FakeEngine(**kwargs).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture
def engine_options() -> Dict[str, Any]:
    """Keyword arguments of the ``engine`` fixture's FakeEngine; override in a module to change them."""
    return {}


@pytest.fixture
def engine(make_engine: EngineFactory, engine_options: Dict[str, Any]) -> FakeEngine:
    """A running FakeEngine (model ``tiny-base``) whose resolver reads ``lora_dir``."""
    return make_engine(**engine_options)
