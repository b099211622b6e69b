"""``python -m lora_sampler.testing``: serve the built-in test engine on a port until Ctrl-C (see ``_serve``)."""

from __future__ import annotations

import sys

from lora_sampler.testing._serve import main

if __name__ == "__main__":
    sys.exit(main())
