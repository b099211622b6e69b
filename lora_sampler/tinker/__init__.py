"""Tinker's ``SamplingClient`` over your own vLLM engine (the ``[tinker]`` extra, Python >= 3.11).

Code written against the Tinker SDK (``tinker`` 0.38) and tinker-cookbook's completers and evaluators runs
unchanged against a vLLM engine serving your LoRA checkpoints::

    from lora_sampler.tinker import ServiceClient

    service = ServiceClient("http://127.0.0.1:8000", lora_base_dir="/srv/loras")
    sampling_client = service.create_sampling_client(model_path="runs/step-400.tar.gz").result()
    response = sampling_client.sample(prompt, num_samples=4, sampling_params=params).result()

``TinkerEvaluator(evaluator)`` runs a sampling-client evaluator (tinker-cookbook's) on every checkpoint of a sweep.
Nothing below the command line imports this module, so ``import lora_sampler`` and a sweep never load tinker.
"""

from __future__ import annotations

import sys

if sys.version_info < (3, 11):  # pragma: no cover - the extra installs nothing below 3.11
    raise ImportError("lora_sampler.tinker needs Python >= 3.11 (tinker 0.38 does); this is " + sys.version.split()[0])
try:
    import tinker as _tinker  # noqa: F401  (checked here, so the message names the extra)
except ImportError as exc:  # pragma: no cover - exercised by the test that runs without tinker
    raise ImportError(
        "lora_sampler.tinker needs the tinker SDK: pip install 'lora_sampler[tinker]' (tinker>=0.38,<0.39)"
    ) from exc

from lora_sampler.tinker._clients import SamplingClient, ServiceClient
from lora_sampler.tinker._evaluator import TinkerEvaluator
from lora_sampler.tinker._future import TinkerFuture

__all__ = ["SamplingClient", "ServiceClient", "TinkerEvaluator", "TinkerFuture"]
