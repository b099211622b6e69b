"""Scoring batch lines: ``{"id", "prompt", "completion"?}`` in, ``{"id", "model", "tokens", "logprobs", "sum"}`` out.

The line parser and the record format of ``lora-sampler score``, and the sweep's scoring step
(``sweep --score``: every checkpoint scored, its ledger line with the mean logprob per token and per line); the
streaming, resume and outages are ``BatchJob``'s, the same as for sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from lora_sampler._adapters.publish import LM_HEAD_NOTE, adapter_targets_lm_head
from lora_sampler._views import json_number
from lora_sampler.batch._lines import (
    METADATA_KEY,
    PROMPT_LINES,
    InputLine,
    LineDefaults,
    add_metadata,
    check_keys,
    parse_object_line,
)
from lora_sampler.batch._steps import SampleStep, answered_records
from lora_sampler.types import Adapter, ScoreOutput, ScoreRequest

#: Keys a scoring line may hold.
SCORE_KEYS = ("id", "prompt", "completion", "session_id", METADATA_KEY)


def parse_score_line(raw: bytes, line_number: int, defaults: LineDefaults) -> Optional[InputLine]:
    """Parse one scoring line; None for a blank line. Never raises for bad content: see ``InputLine.error``."""
    return parse_object_line(raw, line_number, defaults, _score_request)


def _score_request(obj: Dict[str, Any], defaults: LineDefaults) -> ScoreRequest:
    """The request of a scoring-line object (a ``ValueError`` or ``TypeError`` naming what is wrong)."""
    if "prompt" not in obj:
        hint = " (scoring takes prompt lines; chat messages are not scored)" if "messages" in obj else ""
        raise ValueError(f"the line has no 'prompt' (token ids or text) to score{hint}")
    check_keys(obj, SCORE_KEYS, {"messages": "prompt (chat messages are not scored)"}, own=METADATA_KEY)
    return ScoreRequest(
        obj["prompt"],
        obj.get("completion"),
        adapter=defaults.adapter,
        base_model=defaults.base_model,
        session_id=obj.get("session_id"),
    )


def score_record(line: InputLine, output: ScoreOutput) -> Dict[str, Any]:
    """Return the record of a scored line: the scored tokens, their logprobs and their sum."""
    record = {
        "id": line.id,
        "model": output.model,
        "tokens": list(output.scored_tokens),
        "logprobs": [json_number(lp) for lp in output.scored_logprobs],
        "sum": json_number(output.total),
    }
    return add_metadata(record, line)


#: ``lora-sampler score``'s lines and records; errors, resume keys and messages as the prompt lines'.
SCORE_FORMAT = dataclasses.replace(PROMPT_LINES, parse=parse_score_line, result=score_record, kind="score")


def scoring_notes(adapter: Adapter) -> List[str]:
    """What scoring must say of an adapter: that its scores may miss its lm_head delta, when it targets lm_head."""
    return [LM_HEAD_NOTE] if adapter_targets_lm_head(adapter.path) else []


class ScoreStep(SampleStep):
    """Score every input line under the checkpoint's adapter, in ``score``'s record format (``sweep --score``).

    Args:
        source: A JSONL file of scoring lines (``{"id", "prompt", "completion"?}``), or a sequence of such mappings or
            ``ScoreRequest`` values; a file is read again for each checkpoint.
        defaults: Only the model fields matter (replaced per checkpoint).
    """

    line_format = SCORE_FORMAT

    def summary(self, output_path: str) -> Dict[str, Any]:
        """``rows``, ``failed``, ``tokens`` (scored), ``mean_logprob`` (per scored token), ``mean_sum`` (per answered
        line: the mean log-likelihood) and ``mean_length`` (scored tokens per answered line) of an output file.

        A line whose sum is not a number (written as null) counts as a row, not in the means.
        """
        counts = {"rows": 0, "failed": 0}
        tokens = answered = 0
        total = 0.0
        for record in answered_records(output_path, counts):
            if record.get("sum") is not None:
                answered += 1
                tokens += len(record.get("tokens", ()))
                total += float(record["sum"])
        return {
            **counts,
            "tokens": tokens,
            "mean_logprob": json_number(total / tokens) if tokens else None,  # None once sums leave the float range
            "mean_sum": json_number(total / answered) if answered else None,
            "mean_length": tokens / answered if answered else None,
        }
