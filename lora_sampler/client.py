"""The sampling client: the public home of ``SamplerClient`` and the API-key variable's name."""

from __future__ import annotations

from lora_sampler._client.client import (
    IN_FLIGHT_PER_WORKER,
    RequestLike,
    SamplerClient,
)
from lora_sampler._defaults import API_KEY_ENV

__all__ = [
    "API_KEY_ENV",
    "IN_FLIGHT_PER_WORKER",
    "RequestLike",
    "SamplerClient",
]
