"""``lora-sampler score``: the logprobs of every line's tokens under one adapter or the base model.

Its own flags and its job: the preflight, client and job runner are ``sample``'s (resume, progress, summary, exit
status, ``--max-outage``), with the scoring lines and records of ``batch._score``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Union

from lora_sampler._client.client import SamplerClient
from lora_sampler.batch._lines import LineDefaults
from lora_sampler.batch._score import SCORE_FORMAT, scoring_notes
from lora_sampler.cli._runner import BatchRun, run_batch
from lora_sampler.types import Adapter

EPILOG = (
    'Input lines: {"id": str|int (default: the line number), "prompt": [token ids] or "text", "completion": '
    '[token ids] or "text" (optional)}. With a completion, its tokens are scored given the prompt (texts are '
    "tokenized by the engine's /tokenize); without, the prompt's tokens after the first. Output lines: "
    '{"id", "model", "tokens", "logprobs", "sum"} or {"id", "error"}. Exit status: 0 every line scored, 1 some '
    "failed, 2 usage, input or engine error, 130 interrupted."
)


def add_score_arguments(score: argparse.ArgumentParser) -> None:
    """Add ``score``'s own flags (the engine and job flags come from the shared parent parsers)."""
    score.epilog = EPILOG
    which = score.add_mutually_exclusive_group(required=True)
    which.add_argument("--adapter", help="checkpoint (archive or folder; published first) or adapter name")
    which.add_argument("--base-model", help="score under the engine's base model, by this name")
    score.add_argument("-i", "--input", required=True, help="JSONL lines to score, one object a line; - reads stdin")


def score_lines(client: SamplerClient, model: Union[Adapter, str, None], args: argparse.Namespace) -> int:
    """Score every line of ``--input`` into ``--output`` on a client whose engine and adapter passed the preflight.

    An adapter that targets ``lm_head`` gets a note before the job and after its summary (``scoring_notes``).
    """
    notes, name = (scoring_notes(model), model.name) if isinstance(model, Adapter) else ([], "")
    for note in notes:
        print(f"lora-sampler: note: {note}", file=sys.stderr)
    run = BatchRun(
        args.input,
        args.output,
        model.name if isinstance(model, Adapter) else model,
        ordered=args.ordered,
        retry_failed=not args.no_retry_failed,
        quiet=args.quiet,
        max_outage=args.max_outage,
        prompts_per_request=args.prompts_per_request,
        line_format=SCORE_FORMAT,
        limit=args.limit,
        restart=args.restart,
    )
    defaults = LineDefaults(adapter=model if args.adapter else None, base_model=args.base_model)
    status = run_batch(client, run, defaults)
    for note in notes:
        print(f"lora-sampler: note: {name}: {note}", file=sys.stderr)
    return status
