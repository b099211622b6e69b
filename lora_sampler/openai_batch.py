"""The OpenAI batch file format: detecting it, reading its lines and writing its result and error records."""

from __future__ import annotations

from lora_sampler.batch._openai import (
    BATCH_URLS,
    CHAT_URL,
    COMPLETIONS_URL,
    LINE_KEYS,
    OPENAI_BATCH_FORMAT,
    OPENAI_BATCH_RECORDS,
    PROMPT_FORMAT,
    batch_error_record,
    batch_record_key,
    batch_result_record,
    detect_format,
    file_format,
    is_batch_line,
    parse_batch_line,
)

__all__ = [
    "BATCH_URLS",
    "CHAT_URL",
    "COMPLETIONS_URL",
    "LINE_KEYS",
    "OPENAI_BATCH_FORMAT",
    "OPENAI_BATCH_RECORDS",
    "PROMPT_FORMAT",
    "batch_error_record",
    "batch_record_key",
    "batch_result_record",
    "detect_format",
    "file_format",
    "is_batch_line",
    "parse_batch_line",
]
