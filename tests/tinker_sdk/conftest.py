"""Fixtures for ``lora_sampler.tinker`` on FakeEngine: tinker 0.38 (``tox -e tinker``), engines, checkpoints, clients.

Without tinker (every other tox env) each test here skips with the reason, and fails in CI (``tests/_services.py``).
The cookbook tests also need tinker-cookbook 0.6.1 and the CPU torch (``cookbook`` fixture). The engines are the
shared ``make_engine`` and ``engine`` fixtures (``tests/conftest.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, List

import pytest
from _services import require, unavailable

from lora_sampler.testing import ByteTokenizer, FakeEngine, write_adapter

HOW = "run these tests with `tox -e tinker` (Python 3.11 with lora_sampler[tinker])"


@pytest.fixture(autouse=True)
def tinker() -> Any:
    """The tinker SDK: every test here needs it."""
    if sys.version_info < (3, 11):
        unavailable(f"tinker 0.38 needs Python >= 3.11; {HOW}")
    return require("tinker", HOW)


@pytest.fixture
def cookbook() -> Any:
    """tinker-cookbook 0.6.1 with the CPU torch it imports."""
    require("torch", "tox -e tinker installs torch==2.13.0+cpu from this machine's find-links; it could not")
    return require("tinker_cookbook", "tox -e tinker installs tinker-cookbook==0.6.1 with --no-deps; it could not")


@pytest.fixture
def checkpoints(tmp_path: Path) -> List[Path]:
    """Three adapter checkpoint folders of a training run (``run/step-100``, ``-200``, ``-300``), base ``tiny-base``.

    Each step has its own rank (2, 4, 8: within FakeEngine's ``max_lora_rank``), so the three hold different bytes, as
    a real run's checkpoints do: a sweep treats two paths with the same bytes as one adapter under one name.
    """
    folders = []
    for step, rank in ((100, 2), (200, 4), (300, 8)):
        folder = tmp_path / "run" / f"step-{step}"
        write_adapter(folder, base_model="tiny-base", rank=rank)
        folders.append(folder)
    return folders


@pytest.fixture
def service(engine: FakeEngine, lora_dir: Path) -> Iterator[Any]:
    """A ``lora_sampler.tinker.ServiceClient`` on ``engine`` with FakeEngine's tokenizer; closed afterwards."""
    from lora_sampler.tinker import ServiceClient

    with ServiceClient(engine.url, lora_base_dir=lora_dir, tokenizer=ByteTokenizer(engine.vocab_size)) as client:
        yield client
