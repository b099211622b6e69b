"""lm-evaluation-harness on your LoRA checkpoints (the ``[lm-eval]`` extra, Python >= 3.10).

``LoraSamplerLM`` is an lm-eval model, registered as ``lora-sampler``: lm-eval's tasks run on a checkpoint (or the
base model) served by your vLLM engine, every request through a ``SamplerClient``::

    lora-sampler lm-eval run --model lora-sampler \\
        --model_args base_url=http://127.0.0.1:8000,adapter=runs/exp1/step-400.tar.gz,lora_base_dir=/srv/loras \\
        --tasks hellaswag --output_path out/

``main`` is lm-eval's own command line with the model registered (``python -m lora_sampler.lm_eval`` too). lm-eval's
own models (``local-completions``, ``hf``, ``vllm``, ...) stay resolvable. Nothing else in lora_sampler imports
this module, so ``import lora_sampler`` never loads lm-eval.
"""

from __future__ import annotations

import sys

if sys.version_info < (3, 10):  # pragma: no cover - the extra installs nothing below 3.10
    raise ImportError(
        "lora_sampler.lm_eval needs Python >= 3.10 (lm-eval 0.4.13 does); this is Python " + sys.version.split()[0]
    )
try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models first, so that they stay resolvable)
except ImportError as exc:  # pragma: no cover - exercised by the test that runs without lm-eval
    raise ImportError(
        "lora_sampler.lm_eval needs lm-eval: pip install 'lora_sampler[lm-eval]' (lm-eval>=0.4.13)"
    ) from exc

from lm_eval.api.registry import model_registry, register_model

from lora_sampler.lm_eval._command import main
from lora_sampler.lm_eval._model import LoraSamplerLM
from lora_sampler.lm_eval._sweep import LmEvalTasks, metrics_of
from lora_sampler.lm_eval._tokens import TokenCache

#: The name lm-eval knows this model by (``--model lora-sampler``), registered when this package is first imported
#: (which the command line and ``python -m lora_sampler.lm_eval`` do), after lm-eval's own models.
MODEL_NAME = "lora-sampler"
if MODEL_NAME not in model_registry:  # an lm-eval that read the entry point has it already
    register_model(MODEL_NAME)(LoraSamplerLM)

__all__ = ["MODEL_NAME", "LmEvalTasks", "LoraSamplerLM", "TokenCache", "main", "metrics_of"]
