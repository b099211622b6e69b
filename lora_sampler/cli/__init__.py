"""The ``lora-sampler`` command line: ``main(argv)`` runs it and returns the exit status."""

from __future__ import annotations

from lora_sampler.cli._main import TESTING_ENV, build_parser, main
from lora_sampler.cli._parser import UsageError

__all__ = ["TESTING_ENV", "UsageError", "build_parser", "main"]
