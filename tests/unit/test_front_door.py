"""The package's front door: every public name loads on first use, and ``lora_sampler.testing`` stands alone."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import lora_sampler

_STANDALONE = textwrap.dedent("""
    import json, sys, urllib.request
    import lora_sampler.testing
    from lora_sampler.testing import FakeEngine, set_testing

    with set_testing(True), FakeEngine() as engine:
        body = json.dumps({"model": engine.model, "prompt": [1, 2], "max_tokens": 2}).encode()
        request = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            status = answer.status
    loaded = [name for name in ("requests", "urllib3", "backoff", "lora_sampler._client") if name in sys.modules]
    print(json.dumps({"status": status, "loaded": loaded}))
    """)


def test_testing_imports_without_requests_backoff_or_the_client() -> None:
    """A fresh interpreter runs FakeEngine with requests, urllib3, backoff and the client never imported."""
    done = subprocess.run([sys.executable, "-c", _STANDALONE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"status": 200, "loaded": []}'


@pytest.mark.parametrize("name", lora_sampler.__all__)
def test_front_door_name_is_its_implementation(name: str) -> None:
    """Each public name is importable from lora_sampler and is the object its own module defines."""
    value = getattr(lora_sampler, name)
    home = lora_sampler._HOMES.get(name, "lora_sampler._version")
    assert value is getattr(importlib.import_module(home), name)


def test_front_door_dir_lists_every_public_name_and_refuses_others() -> None:
    """dir() shows the public names before they load, and a misspelt name is an AttributeError naming it."""
    assert set(lora_sampler.__all__) <= set(dir(lora_sampler))
    with pytest.raises(AttributeError, match="SamplerClinet"):
        _ = lora_sampler.SamplerClinet  # type: ignore[attr-defined]


def test_front_door_star_import_gives_every_public_name() -> None:
    """``from lora_sampler import *`` binds exactly the names of __all__."""
    namespace: dict = {}
    exec("from lora_sampler import *", namespace)
    assert set(lora_sampler.__all__) <= set(namespace)
