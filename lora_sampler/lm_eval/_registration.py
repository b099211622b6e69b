"""``lora-sampler`` in lm-eval's model registry: registered once, when this module is first imported.

The package and its command line (``_command``) both import it, so ``--model lora-sampler`` resolves whichever
runs first. lm-eval's own models are imported before, so that they stay resolvable.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval's own models first, so that they stay resolvable)
from lm_eval.api.registry import model_registry, register_model

from lora_sampler.lm_eval._model import LoraSamplerLM

#: The name lm-eval knows this model by (``--model lora-sampler``).
MODEL_NAME = "lora-sampler"

if MODEL_NAME not in model_registry:  # an lm-eval that read the entry point has it already
    register_model(MODEL_NAME)(LoraSamplerLM)
