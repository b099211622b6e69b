"""``python -m lora_sampler``: the command line."""

from lora_sampler.cli import main

raise SystemExit(main())
