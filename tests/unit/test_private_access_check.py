"""tools/check_private_access.py (run by ``tox -e lint``): the package is clean, and each kind of private use fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_private_access", ROOT / "tools" / "check_private_access.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checker = load_checker()


def test_private_access_check_passes_on_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    """lora_sampler uses no private name of another package and swaps no class."""
    assert checker.main([str(ROOT / "lora_sampler")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import requests\nrequests.auth._basic_auth_str('a', 'b')\n", "._basic_auth_str"),
        ("def f(response):\n    response._content = b''\n", "._content"),
        ("def f(sock):\n    sock._io_refs += 1\n", "._io_refs"),
        ("def f(future, cls):\n    future.__class__ = cls\n", "__class__"),
        ("def f(future, cls):\n    setattr(future, '__class__', cls)\n", "__class__"),
        ("def f(fs):\n    return getattr(fs, '_strip_protocol')('x')\n", "_strip_protocol"),
        ("from requests.utils import _parse_content_type_header\n", "_parse_content_type_header"),
        ("from urllib3._collections import HTTPHeaderDict\n", "urllib3._collections"),
        ("import concurrent.futures._base\n", "concurrent.futures._base"),
    ],
    ids=[
        "call",
        "write",
        "augmented",
        "class swap",
        "setattr swap",
        "getattr",
        "private name",
        "private module",
        "import",
    ],
)
def test_private_access_check_fails_on_each_kind(
    source: str, found: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each kind of private use of another package is reported with its line, and the exit status is 1."""
    (tmp_path / "module.py").write_text(source)
    assert checker.main([str(tmp_path)]) == 1
    assert found in capsys.readouterr().out


def test_private_access_check_allows_own_names_and_documented_exceptions(tmp_path: Path) -> None:
    """Names the package defines itself (self._x, module and class names) and the listed exceptions pass."""
    (tmp_path / "module.py").write_text(
        "import os\nimport collections\n_CACHE = {}\n\n"
        "class Box:\n    __slots__ = ('_slot',)\n\n    def __init__(self):\n        self._slot = 1\n\n"
        "    def _helper(self):\n        return self._slot\n\n"
        "def f(other: Box, point):\n    other._helper()\n    point._replace(x=1)\n    os._exit(0)\n"
    )
    assert checker.main([str(tmp_path)]) == 0
