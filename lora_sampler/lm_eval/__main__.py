"""``python -m lora_sampler.lm_eval ARGS...``: lm-eval's own command line, with ``--model lora-sampler``."""

from __future__ import annotations

import sys

from lora_sampler.lm_eval import main

if __name__ == "__main__":
    sys.exit(main())
