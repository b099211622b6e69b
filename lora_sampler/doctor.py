"""The end-to-end engine check behind ``lora-sampler doctor``."""

from __future__ import annotations

from lora_sampler._client.selfcheck import Finding
from lora_sampler.cli._doctor import (
    DEFAULT_PROBE_WAIT,
    PROBE_PREFIX,
    check_adapter,
    check_engine,
    check_replica_folder,
    check_replicas,
    check_resolver_dir,
    check_runtime_updating,
    run_checks,
)

__all__ = [
    "DEFAULT_PROBE_WAIT",
    "Finding",
    "PROBE_PREFIX",
    "check_adapter",
    "check_engine",
    "check_replica_folder",
    "check_replicas",
    "check_resolver_dir",
    "check_runtime_updating",
    "run_checks",
]
