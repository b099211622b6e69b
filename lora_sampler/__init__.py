"""lora_sampler: a synchronous client for sampling LoRA adapters from a vLLM engine, through the load race.

The front door: everything public is re-exported here. ``lora_sampler.testing`` holds the built-in test engine.
"""

from __future__ import annotations

import logging

from lora_sampler._adapters.extract import PublishLimits
from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageEvent, OutageHook
from lora_sampler._version import __version__
from lora_sampler.errors import (
    AdapterConfigError,
    AdapterNotReadyError,
    AuthenticationError,
    BatchInputError,
    EngineConnectionError,
    EngineConnectTimeoutError,
    EngineError,
    EngineProtocolError,
    EngineStatusError,
    EngineTimeoutError,
    FleetError,
    LoraSamplerError,
    ModelNotFoundError,
    PublishError,
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
)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Adapter",
    "AdapterConfigError",
    "AdapterNotReadyError",
    "AuthenticationError",
    "BatchInputError",
    "EngineConnectTimeoutError",
    "EngineConnectionError",
    "EngineError",
    "EngineProtocolError",
    "EngineStatusError",
    "EngineTimeoutError",
    "FleetError",
    "GeneratedSequence",
    "LoraSamplerError",
    "ModelNotFoundError",
    "OutageEvent",
    "OutageHook",
    "PromptTopK",
    "PublishError",
    "PublishLimits",
    "RetryEvent",
    "RetryHook",
    "RetryPolicy",
    "SampleOutput",
    "SampleRequest",
    "SamplerClient",
    "SamplingParams",
    "ScoreOutput",
    "ScoreRequest",
    "UnsafeArchiveError",
    "__version__",
]
