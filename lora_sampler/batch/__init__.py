"""Batch jobs as a library: input lines, output records, resumable output files, and checkpoint sweeps."""

from __future__ import annotations

from lora_sampler.batch._lines import (
    PROMPT_RECORDS,
    SAMPLING_KEYS,
    UTF8_BOM,
    InputLine,
    LineDefaults,
    LineId,
    LineParser,
    RecordFormat,
    RecordKey,
    ResumeState,
    count_lines,
    error_record,
    id_key,
    parse_line,
    prepare_output,
    read_input,
    record_key,
    result_record,
    write_record,
)
from lora_sampler.batch._sources import Checkpoint, Manifest, checkpoint_fingerprint, expand_pattern
from lora_sampler.batch._steps import EvaluationStep, SampleStep
from lora_sampler.batch._sweep import CheckpointReport, Sweep, SweepSettings, sweep

__all__ = [
    "Checkpoint",
    "CheckpointReport",
    "EvaluationStep",
    "Manifest",
    "SampleStep",
    "Sweep",
    "SweepSettings",
    "checkpoint_fingerprint",
    "expand_pattern",
    "sweep",
    "InputLine",
    "LineDefaults",
    "LineId",
    "LineParser",
    "PROMPT_RECORDS",
    "RecordFormat",
    "RecordKey",
    "ResumeState",
    "SAMPLING_KEYS",
    "UTF8_BOM",
    "count_lines",
    "error_record",
    "id_key",
    "parse_line",
    "prepare_output",
    "read_input",
    "record_key",
    "result_record",
    "write_record",
]
