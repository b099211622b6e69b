"""Batch jobs as a library: input lines, output records and resumable output files."""

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

__all__ = [
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
