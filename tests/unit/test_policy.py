"""RetryPolicy as a value: validation, the wait schedule, jitter and the testing switch."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from lora_sampler import RetryPolicy, retry
from lora_sampler.errors import (
    AdapterNotReadyError,
    AuthenticationError,
    EngineConnectionError,
    EngineStatusError,
    EngineTimeoutError,
    ModelNotFoundError,
)


def test_policy_default_schedule_doubles_and_caps() -> None:
    """Waits double from 0.125 s and are capped at 2.0 s; 6 attempts mean 5 waits of ~3.9 s nominal."""
    policy = RetryPolicy()
    assert policy.max_attempts == 6
    waits = list(itertools.islice(policy.delays(), 7))
    assert waits == [0.125, 0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert sum(waits[: policy.max_attempts - 1]) == 3.875


def test_policy_jitter_stays_between_half_and_all() -> None:
    """Each jittered wait lies in [w/2, w], and they differ (no lockstep)."""
    random.seed(1)
    draws = [retry.jitter(1.0) for _ in range(1000)]
    assert all(0.5 <= d <= 1.0 for d in draws)
    assert len(set(draws)) > 900


def test_policy_testing_switch_zeroes_waits_and_restores() -> None:
    """set_testing() makes waits 0 as a call and as a context manager that restores the old state."""
    assert retry.jitter(1.0) > 0
    with retry.set_testing(True):
        assert retry.jitter(1.0) == 0.0 and retry.is_testing()
        with retry.set_testing(False):
            assert retry.jitter(1.0) > 0
        assert retry.is_testing()
    assert not retry.is_testing()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"base_delay": -1}, "base_delay"),
        ({"max_delay": 0.01}, "max_delay"),
        ({"load_timeout": "x"}, "load_timeout"),
        ({"base_delay": math.nan, "max_delay": math.nan}, "base_delay must be a number of seconds >= 0"),
        ({"load_timeout": math.nan}, "load_timeout"),
        ({"on_retry": [1]}, "on_retry"),
    ],
)
def test_policy_validation_names_the_field(kwargs: dict, field: str) -> None:
    """An invalid policy field raises naming it."""
    with pytest.raises((ValueError, TypeError), match=field):
        RetryPolicy(**kwargs)


def test_policy_is_immutable_and_hooks_normalise_to_tuples() -> None:
    """The policy is frozen; a single hook becomes a one-item tuple; replace() makes new values."""
    policy = RetryPolicy(on_retry=print)
    assert policy.on_retry == (print,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_attempts = 2  # type: ignore[misc]
    assert dataclasses.replace(policy, max_attempts=2).max_attempts == 2


def test_policy_table_by_error_class() -> None:
    """should_retry follows the retry table from the error alone."""
    policy = RetryPolicy()
    assert policy.should_retry(EngineConnectionError("x", adapter=False))
    assert policy.should_retry(EngineTimeoutError("x", adapter=True))
    assert policy.should_retry(ModelNotFoundError("x", adapter=True, status=404))
    assert not policy.should_retry(ModelNotFoundError("x", adapter=False, status=404))
    assert policy.should_retry(AdapterNotReadyError("x", adapter=True, status=400))
    assert not policy.should_retry(AuthenticationError("x", adapter=True, status=401))
    assert not policy.should_retry(EngineStatusError("x", adapter=True, status=503))
    assert RetryPolicy(retry_overloaded=True).should_retry(EngineStatusError("x", status=503))
    assert not policy.should_retry(ValueError("x"))
