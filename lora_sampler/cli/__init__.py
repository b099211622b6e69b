"""The ``lora-sampler`` command line."""

from __future__ import annotations

from lora_sampler.cli._main import (
    COMMANDS,
    DEFAULT_MAX_OUTAGE,
    DEFAULT_TIMEOUT,
    GIB,
    TESTING_ENV,
    build_parser,
    cmd_demo,
    cmd_doctor,
    cmd_publish,
    cmd_sample,
    cmd_unload,
    main,
    parse_timeout,
)
from lora_sampler.cli._parser import UsageError

__all__ = [
    "COMMANDS",
    "DEFAULT_MAX_OUTAGE",
    "DEFAULT_TIMEOUT",
    "GIB",
    "TESTING_ENV",
    "UsageError",
    "build_parser",
    "cmd_demo",
    "cmd_doctor",
    "cmd_publish",
    "cmd_sample",
    "cmd_unload",
    "main",
    "parse_timeout",
]
