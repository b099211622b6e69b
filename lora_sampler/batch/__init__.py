"""Batch jobs as a library: input lines, output records, resumable output files, and checkpoint sweeps."""

from __future__ import annotations

from lora_sampler.batch._evaluator import CheckpointEvaluator, EvaluatedCheckpoint, EvaluatorError
from lora_sampler.batch._lines import (
    PROMPT_LINES,
    SAMPLING_KEYS,
    UTF8_BOM,
    InputLine,
    LineDefaults,
    LineFormat,
    LineId,
    LineParser,
    RecordKey,
    ResumeState,
    count_lines,
    error_record,
    id_key,
    one_writer,
    open_output,
    parse_line,
    prepare_output,
    read_input,
    record_key,
    result_record,
    to_json_line,
    write_record,
)
from lora_sampler.batch._score import SCORE_FORMAT, ScoreStep, parse_score_line, score_record
from lora_sampler.batch._settings import SweepSettings
from lora_sampler.batch._sources import Checkpoint, Manifest, checkpoint_fingerprint, expand_pattern
from lora_sampler.batch._steps import SampleStep
from lora_sampler.batch._sweep import CheckpointReport, Sweep, sweep

__all__ = [
    "Checkpoint",
    "CheckpointEvaluator",
    "EvaluatedCheckpoint",
    "EvaluatorError",
    "CheckpointReport",
    "Manifest",
    "SampleStep",
    "ScoreStep",
    "SCORE_FORMAT",
    "parse_score_line",
    "score_record",
    "Sweep",
    "SweepSettings",
    "checkpoint_fingerprint",
    "expand_pattern",
    "sweep",
    "InputLine",
    "LineDefaults",
    "LineId",
    "LineParser",
    "LineFormat",
    "PROMPT_LINES",
    "RecordKey",
    "ResumeState",
    "SAMPLING_KEYS",
    "UTF8_BOM",
    "count_lines",
    "error_record",
    "id_key",
    "one_writer",
    "open_output",
    "parse_line",
    "prepare_output",
    "read_input",
    "record_key",
    "result_record",
    "to_json_line",
    "write_record",
]
