"""lora_sampler: a synchronous client for sampling LoRA adapters from a vLLM engine, through the load race.

The front door: every public name is importable from here. Names load on first use (PEP 562), so importing
``lora_sampler.testing`` or another stdlib-only part of the package does not import requests, backoff or the client.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Dict, List

from lora_sampler._version import __version__

if TYPE_CHECKING:  # the names as mypy and IDEs see them; at run time ``__getattr__`` imports them on first use
    from lora_sampler._adapters.extract import PublishLimits
    from lora_sampler._client.client import SamplerClient
    from lora_sampler._client.outage import OutageEvent, OutageHook
    from lora_sampler._client.selfcheck import Finding, ScoringCheck
    from lora_sampler.batch._settings import SweepSettings
    from lora_sampler.batch._sweep import CheckpointReport, sweep
    from lora_sampler.errors import (
        AdapterConfigError,
        AdapterNotFoundError,
        AdapterNotReadyError,
        AuthenticationError,
        BadRequestError,
        BatchInputError,
        CheckpointIncompleteError,
        CheckpointMissingError,
        EngineConnectionError,
        EngineConnectTimeoutError,
        EngineError,
        EngineProtocolError,
        EngineStatusError,
        EngineTimeoutError,
        FleetError,
        IncompleteCheckpointError,
        InternalServerError,
        LoraSamplerError,
        ModelNotFoundBadRequestError,
        ModelNotFoundError,
        NotFoundError,
        OutputSettingsError,
        PermissionDeniedError,
        PublishError,
        RateLimitError,
        RequestCancelledError,
        SamplingInterruptedError,
        UnprocessableEntityError,
        UnsafeArchiveError,
    )
    from lora_sampler.retry import RetryEvent, RetryHook, RetryPolicy
    from lora_sampler.types import (
        Adapter,
        GeneratedSequence,
        PromptTopK,
        SampleOutput,
        SampleRequest,
        SamplingParams,
        ScoreOutput,
        ScoreRequest,
        Usage,
    )

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Adapter",
    "AdapterConfigError",
    "AdapterNotFoundError",
    "AdapterNotReadyError",
    "AuthenticationError",
    "BadRequestError",
    "BatchInputError",
    "CheckpointReport",
    "EngineConnectTimeoutError",
    "EngineConnectionError",
    "EngineError",
    "EngineProtocolError",
    "EngineStatusError",
    "EngineTimeoutError",
    "Finding",
    "FleetError",
    "GeneratedSequence",
    "CheckpointIncompleteError",
    "CheckpointMissingError",
    "IncompleteCheckpointError",
    "InternalServerError",
    "LoraSamplerError",
    "ModelNotFoundBadRequestError",
    "ModelNotFoundError",
    "NotFoundError",
    "OutageEvent",
    "OutageHook",
    "OutputSettingsError",
    "PermissionDeniedError",
    "PromptTopK",
    "PublishError",
    "PublishLimits",
    "RateLimitError",
    "RequestCancelledError",
    "RetryEvent",
    "RetryHook",
    "RetryPolicy",
    "SampleOutput",
    "SampleRequest",
    "SamplerClient",
    "SamplingInterruptedError",
    "SamplingParams",
    "ScoreOutput",
    "ScoreRequest",
    "ScoringCheck",
    "SweepSettings",
    "UnprocessableEntityError",
    "UnsafeArchiveError",
    "Usage",
    "__version__",
    "sweep",
]

#: The public names each module defines: ``__getattr__`` imports a name from its module on first use.
_NAMES_BY_MODULE = {
    "lora_sampler._adapters.extract": ("PublishLimits",),
    "lora_sampler._client.client": ("SamplerClient",),
    "lora_sampler._client.outage": ("OutageEvent", "OutageHook"),
    "lora_sampler._client.selfcheck": ("Finding", "ScoringCheck"),
    "lora_sampler.batch._settings": ("SweepSettings",),
    "lora_sampler.batch._sweep": ("CheckpointReport", "sweep"),
    "lora_sampler.errors": tuple(name for name in __all__ if name.endswith("Error")),
    "lora_sampler.retry": ("RetryEvent", "RetryHook", "RetryPolicy"),
    "lora_sampler.types": (
        "Adapter",
        "GeneratedSequence",
        "PromptTopK",
        "SampleOutput",
        "SampleRequest",
        "SamplingParams",
        "ScoreOutput",
        "ScoreRequest",
        "Usage",
    ),
}
_HOMES: Dict[str, str] = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}


if not TYPE_CHECKING:  # mypy reads the imports above, and still flags a name that is not public

    def __getattr__(name: str) -> Any:
        """Import a public name from its module on first use, and keep it here for the next one."""
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'lora_sampler' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value


def __dir__() -> List[str]:
    """The module's attributes, the public names not yet loaded included."""
    return sorted(set(globals()) | set(__all__))
