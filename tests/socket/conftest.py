"""Fixtures shared by the loopback tests: running FakeEngines reading ``lora_dir``, always stopped afterwards.

A module that needs engine options overrides ``engine_options`` (e.g. ``{"max_loras": 2}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

from lora_sampler.testing import FakeEngine

EngineFactory = Callable[..., FakeEngine]


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
    """A running FakeEngine whose resolver reads ``lora_dir``."""
    return make_engine(**engine_options)
