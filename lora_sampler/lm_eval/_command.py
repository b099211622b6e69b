"""lm-eval's own command line, its arguments unchanged, run with ``lora-sampler`` registered.

lm-eval 0.4.13's entry point, ``cli_evaluate``, reads ``sys.argv``: ``main`` sets it for the call and puts it back.
The package registers the model when imported, before ``main`` can be called.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``lm-eval ARGS...`` (``argv``, default ``sys.argv[1:]``); return its exit status.

    ``lora-sampler lm-eval run --model lora-sampler --model_args base_url=...,adapter=... --tasks ...`` is
    ``lm-eval run ...`` with this package's model known to it.
    """
    from lm_eval.__main__ import cli_evaluate

    arguments = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *arguments]
    try:
        cli_evaluate()
    except SystemExit as exit_:
        code = exit_.code
        if isinstance(code, str):  # a message in place of a status: say it, as the interpreter would have
            print(code, file=sys.stderr)
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
