"""Publishing checkpoints into the resolver's folder: content names, config checks, atomic publish and removal."""

from __future__ import annotations

from lora_sampler._adapters.archive import (
    MARKER_FILE,
    checkpoint_digest,
    clean_stale_temporaries,
)
from lora_sampler._adapters.extract import (
    PublishLimits,
)
from lora_sampler._adapters.publish import (
    CONFIG_FILE,
    DEFAULT_DIGEST_CHARS,
    DEFAULT_DURABLE,
    DEFAULT_STEM_LENGTH,
    check_adapter_config,
    default_adapter_name,
    publish_checkpoint,
    read_published_digest,
    remove_adapter_dir,
)
from lora_sampler.names import (
    validate_adapter_name,
)

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_DIGEST_CHARS",
    "DEFAULT_DURABLE",
    "DEFAULT_STEM_LENGTH",
    "MARKER_FILE",
    "PublishLimits",
    "check_adapter_config",
    "checkpoint_digest",
    "clean_stale_temporaries",
    "default_adapter_name",
    "publish_checkpoint",
    "read_published_digest",
    "remove_adapter_dir",
    "validate_adapter_name",
]
