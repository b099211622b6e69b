"""The [lm-eval] extra is optional: without it (or below Python 3.10) the import error names what to do, and the
``lora-sampler lm-eval`` command says so in one line. (tox -e lmeval runs the model itself.)"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from lora_sampler.cli import main

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None


@pytest.mark.skipif(HAS_LM_EVAL and sys.version_info >= (3, 10), reason="lm-eval is installed here")
def test_import_names_the_extra_or_the_python_version() -> None:
    """Below 3.10 the message names the Python version; without lm-eval, the extra to install."""
    expected = "Python >= 3.10" if sys.version_info < (3, 10) else r"lora_sampler\[lm-eval\]"
    with pytest.raises(ImportError, match=expected):
        import lora_sampler.lm_eval  # noqa: F401


@pytest.mark.skipif(HAS_LM_EVAL and sys.version_info >= (3, 10), reason="lm-eval is installed here")
def test_the_command_says_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lm-eval", "run", "--model", "lora-sampler"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("lora-sampler: error: lora_sampler.lm_eval needs") and error.count("\n") == 1
