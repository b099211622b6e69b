"""A local Ray on loopback only, started once for the ray tests and always shut down.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray on 127.0.0.1 (without it Ray binds to the machine's
non-loopback address even when asked for 127.0.0.1); ``RAY_AUTH_MODE=disabled`` and a ``HOME``
inside the test's tmp dir keep Ray's token and files out of the real home; ``_temp_dir`` is a short path inside
the tmp dir, because Ray's socket paths have a length limit. Workers inherit this environment, which is how the
engine's API key reaches them (by variable name, never in a pickled object).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
from _services import require

#: The engine key the ray tests use; workers read it from ENGINE_KEY_ENV.
ENGINE_KEY = "sk-ray-test-Zq8JH2b6Xw"
ENGINE_KEY_ENV = "LORA_SAMPLER_RAY_TEST_KEY"


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory: Any) -> Iterator[Any]:
    """Start a 2-CPU local Ray bound to 127.0.0.1; shut it down after the session."""
    base = tmp_path_factory.mktemp("ray")
    home = base / "home"
    home.mkdir()
    names = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "HOME", ENGINE_KEY_ENV)
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
            "HOME": str(home),
            ENGINE_KEY_ENV: ENGINE_KEY,
        }
    )
    try:
        # Imported only now: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported. Installed by
        # `tox -e ray` (lora_sampler[ray]); a missing ray skips the tests here and fails them in CI.
        ray = require("ray", "run these tests with `tox -e ray` (lora_sampler[ray])")
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:  # ray was imported before the variable was set: it would bind eth0
            pytest.fail(
                "ray was imported with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset; run `tox -e ray`", pytrace=False
            )
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=str(base / "t"),
            log_to_driver=False,
        )
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
