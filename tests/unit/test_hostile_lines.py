"""Issue 23's hostile input lines and output records: every bad line is an error row, every record strict JSON.

No sockets: the parsers of both input formats, the input reader and the record writer, on the probe's inputs.
"""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path
from typing import Any, List

import pytest

from lora_sampler.batch import LineDefaults, parse_line, read_input, to_json_line, write_record
from lora_sampler.errors import BatchInputError, LoraSamplerError
from lora_sampler.openai_batch import detect_format, first_line, parse_batch_line

DEFAULTS = LineDefaults(base_model="m")
#: What the batch format needs besides the model: the defaults name none, so body.model does.
BATCH_DEFAULTS = LineDefaults()
DEEP = b"[" * 100_000 + b"]" * 100_000


def strict(text: str) -> Any:
    """Parse ``text`` as a strict JSON reader would: NaN and Infinity are refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def batch(custom_id: str, model: str = "a", **body: Any) -> bytes:
    """One OpenAI batch line."""
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"model": model, **body}}
    return json.dumps(line).encode()


@pytest.mark.parametrize("raw", [DEEP, b'{"id": "x", "prompt": ' + b"[" * 100_000 + b"}"])
def test_lines_nested_100000_deep_is_an_error_row(raw: bytes) -> None:
    """A line nested 100,000 deep (a RecursionError before) is an error row in both formats, naming the nesting."""
    for parsed in (parse_line(raw, 3, DEFAULTS), parse_batch_line(raw, 3, BATCH_DEFAULTS)):
        assert parsed is not None and parsed.request is None and "nested too deep" in parsed.error
        assert parsed.line_number == 3


def test_lines_first_line_nested_deep_does_not_break_format_detection() -> None:
    """Format detection reads a 100,000-deep first line as not a batch line (a traceback before)."""
    found, lines = detect_format([DEEP + b"\n", b'{"prompt": [1]}\n'])
    assert found == "jsonl" and len(list(lines)) == 2


def test_lines_lone_surrogate_in_an_id_is_an_error_row_by_line_number() -> None:
    """An id or custom_id holding a lone surrogate (\\ud800) is an error row keyed by its line number."""
    prompt_line = parse_line(b'{"id": "a\\ud800", "prompt": [1]}', 7, DEFAULTS)
    batch_line = parse_batch_line(batch("a\ud800"), 7, BATCH_DEFAULTS)
    for parsed in (prompt_line, batch_line):
        assert parsed is not None and parsed.request is None and parsed.line_number == 7
        assert parsed.id in (None, 7) and parsed.key in ("#line7", "7")
        assert "lone surrogate (\\ud800)" in parsed.error
        to_json_line({"id": parsed.id, "error": parsed.error}).encode("utf-8")  # writable as UTF-8


@pytest.mark.parametrize("raw", [b"\x0b", b"\x0c", b" \x0c \r\n", b"\x0b\x0c"])
def test_lines_of_vertical_tab_or_form_feed_get_a_row(raw: bytes) -> None:
    """A line of \\x0b or \\x0c is not blank to JSON: it gets an error row (it vanished before)."""
    for parsed in (parse_line(raw, 2, DEFAULTS), parse_batch_line(raw, 2, BATCH_DEFAULTS)):
        assert parsed is not None and parsed.request is None and "not valid JSON" in parsed.error


def test_lines_a_first_line_of_vertical_tab_is_no_blank_line_to_format_detection() -> None:
    """The input's first line is found by the readers' blank rule: a line of \\x0b is a line (it was skipped)."""
    first, lines = first_line([b"\n", b"\x0b\n", b"{}\n"])
    assert first == b"\x0b\n" and list(lines) == [b"\n", b"\x0b\n", b"{}\n"]
    assert first_line([b"\n", b" \t\r\n"])[0] is None


def test_lines_blank_lines_of_json_whitespace_still_vanish() -> None:
    """Lines of spaces, tabs and line ends are blank: no row, as before."""
    assert parse_line(b" \t\r\n", 1, DEFAULTS) is None and parse_batch_line(b"\n", 1, BATCH_DEFAULTS) is None


@pytest.mark.parametrize("value", ['"false"', '"true"', "1", "0", "null"])
def test_lines_prompt_logprobs_must_be_a_boolean(value: str) -> None:
    """``"prompt_logprobs": "false"`` (a string) is an error row; it turned prompt logprobs on before."""
    parsed = parse_line(f'{{"prompt": [1], "prompt_logprobs": {value}}}'.encode(), 1, DEFAULTS)
    assert parsed is not None and parsed.request is None and "prompt_logprobs must be true or false" in parsed.error


def test_lines_prompt_logprobs_true_and_false_still_work() -> None:
    """Booleans keep their meaning."""
    on = parse_line(b'{"prompt": [1], "prompt_logprobs": true}', 1, DEFAULTS)
    off = parse_line(b'{"prompt": [1], "prompt_logprobs": false}', 1, DEFAULTS)
    assert on is not None and on.request is not None and on.request.prompt_logprobs
    assert off is not None and off.request is not None and not off.request.prompt_logprobs


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_lines_utf16_input_is_refused_naming_the_encoding(encoding: str) -> None:
    """A UTF-16 (or UTF-32) input is refused at line 1 naming the encoding and the fix; no phantom line is read."""
    text = '{"id": "a", "prompt": [1]}\n{"id": "b", "prompt": [2]}\n{"id": "c", "prompt": [3]}\n'
    stream = io.BytesIO(text.encode(encoding))
    seen: List[Any] = []
    with pytest.raises(BatchInputError, match="UTF-16") as info:
        seen.extend(read_input(stream, DEFAULTS, name="in.jsonl"))
    assert seen == [] and info.value.line_number == 1 and "iconv" in str(info.value)


def test_lines_body_model_path_is_an_error_row_unless_allowed(tmp_path: Path) -> None:
    """A batch line whose body.model is a local path is refused unless --allow-model-paths allows it."""
    folder = str(tmp_path / "ckpt")
    for model in (folder, "step-1.tar.gz", "../elsewhere"):
        parsed = parse_batch_line(batch("c1", model, prompt="hi"), 1, BATCH_DEFAULTS)
        assert parsed is not None and parsed.request is None and "--allow-model-paths" in parsed.error
    allowed = parse_batch_line(batch("c1", folder, prompt="hi"), 1, LineDefaults(allow_model_paths=True))
    assert allowed is not None and allowed.request is not None and allowed.request.adapter == folder
    named = parse_batch_line(batch("c1", "step-1", prompt="hi"), 1, BATCH_DEFAULTS)
    assert named is not None and named.request is not None and named.request.adapter == "step-1"


def test_lines_body_model_naming_the_served_base_model_by_its_path_is_a_base_model_request(tmp_path: Path) -> None:
    """vLLM serves a model under its folder's path: a line naming that path is a base-model request, not refused."""
    served = str(tmp_path / "models" / "tiny-model")
    parsed = parse_batch_line(batch("c1", served, prompt="hi"), 1, LineDefaults(base_models=(served,)))
    assert parsed is not None and parsed.request is not None
    assert (parsed.request.base_model, parsed.request.adapter) == (served, None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_records_non_finite_numbers_are_written_as_null(value: float) -> None:
    """A NaN or an Infinity in a record is written as null: every output line is strict JSON."""
    record = {"id": 1, "sequences": [{"logprobs": [-0.5, value]}], "body": {"x": value}}
    line = to_json_line(record)
    assert strict(line) == {"id": 1, "sequences": [{"logprobs": [-0.5, None]}], "body": {"x": None}}


def test_records_lone_surrogates_are_written_as_escapes() -> None:
    """Text holding a lone surrogate is written as a JSON escape, so the line is UTF-8 (a UnicodeEncodeError before)."""
    stream = io.StringIO()
    write_record(stream, {"id": "x", "text": "a\ud800b", "other": "é"})
    written = stream.getvalue()
    written.encode("utf-8")
    assert strict(written) == {"id": "x", "text": "a\ud800b", "other": "é"}


def test_records_a_full_disk_names_the_output_and_says_it_resumes() -> None:
    """A write that fails with ENOSPC raises an error naming the output path and saying the output is resumable."""

    class FullDisk(io.StringIO):
        name = "/data/out.jsonl"

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(LoraSamplerError) as info:
        write_record(FullDisk(), {"id": 1})
    message = str(info.value)
    assert "/data/out.jsonl" in message and "No space left on device" in message and "resumable" in message
