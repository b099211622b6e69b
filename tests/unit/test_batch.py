"""Batch input parsing, the resume set, torn-line repair and the atomic rewrite (no sockets)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lora_sampler import SampleOutput, SampleRequest
from lora_sampler.batch import (
    PROMPT_LINES,
    InputLine,
    LineDefaults,
    count_lines,
    error_record,
    id_key,
    open_output,
    parse_line,
    prepare_output,
    read_input,
    result_record,
    write_record,
)
from lora_sampler.errors import BatchInputError, ModelNotFoundError, OutputSettingsError
from lora_sampler.types import GeneratedSequence, SamplingParams

DEFAULTS = LineDefaults(base_model="tiny-base", sampling_params=SamplingParams(max_tokens=4, temperature=0.5))


def jsonl(*records: Any) -> bytes:
    """Encode records (or raw strings) as JSONL bytes."""
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in records)


def write_lines(path: Path, lines: List[Dict[str, Any]], tail: str = "") -> None:
    """Write output records, then an optional raw tail (a torn line)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + tail, encoding="utf-8")


def read_records(path: Path) -> List[Dict[str, Any]]:
    """Read every line of an output file as JSON."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parse_line_uses_flag_defaults_and_line_overrides() -> None:
    """Per-line sampling keys override the flag defaults; the rest comes from the flags."""
    line = parse_line(b'{"id": "a", "prompt": [5, 6], "max_tokens": 9, "seed": 3, "num_samples": 2}', 1, DEFAULTS)
    assert line is not None and line.request is not None
    assert line.id == "a" and line.error == ""
    assert line.request.num_samples == 2
    params = line.request.sampling_params
    assert params is not None and (params.max_tokens, params.temperature, params.seed) == (9, 0.5, 3)
    assert line.request.base_model == "tiny-base"


def test_parse_line_defaults_the_id_to_the_line_number() -> None:
    """A line without an id is known by its line number."""
    line = parse_line(b'{"prompt": "hello", "session_id": "s1"}', 7, DEFAULTS)
    assert line is not None and line.id == 7 and line.request is not None
    assert line.request.session_id == "s1"


def test_parse_line_skips_blank_lines() -> None:
    """Blank lines are not records."""
    assert parse_line(b"  \n", 3, DEFAULTS) is None


@pytest.mark.parametrize(
    ("raw", "expected_id", "phrase"),
    [
        (b"{not json\n", None, "not valid JSON"),
        (b"[1, 2]\n", None, "JSON object"),
        (b'{"id": "x"}\n', "x", "no 'prompt'"),
        (b'{"id": 1.5, "prompt": "a"}\n', None, "id must be"),
        (b'{"id": "y", "prompt": []}\n', "y", "prompt must not be empty"),
        (b'{"id": "z", "prompt": "a", "max_tokens": 0}\n', "z", "max_tokens"),
        (b'\xff\xfe{"prompt": 1}\n', None, "not valid JSON"),
    ],
)
def test_parse_line_reports_bad_lines_without_raising(raw: bytes, expected_id: Any, phrase: str) -> None:
    """A bad line becomes an InputLine with an error that says what is wrong."""
    line = parse_line(raw, 4, DEFAULTS)
    assert line is not None and line.request is None
    assert line.id == expected_id
    assert phrase in line.error
    assert line.key == (json.dumps(expected_id) if expected_id is not None else "#line4")  # never an id's key


def test_read_input_streams_and_numbers_lines() -> None:
    """read_input yields non-blank lines with their 1-based line numbers."""
    data = jsonl({"id": "a", "prompt": "x"}, "", {"prompt": [5]}, "oops")
    lines = list(read_input(io.BytesIO(data), DEFAULTS))
    assert [(line.line_number, line.id) for line in lines] == [(1, "a"), (3, 3), (4, None)]
    assert lines[2].error and lines[2].key == "#line4"


def test_read_input_duplicate_id_names_both_lines() -> None:
    """A repeated id is an error naming the first and the repeating line."""
    data = jsonl({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x"}, {"id": "a", "prompt": "y"})
    lines = read_input(io.BytesIO(data), DEFAULTS, name="prompts.jsonl")
    assert next(lines).id == "a" and next(lines).id == "b"
    with pytest.raises(BatchInputError) as info:
        next(lines)
    assert "line 3" in str(info.value) and "line 1" in str(info.value)
    assert info.value.line_number == 3 and info.value.path == "prompts.jsonl"


def test_read_input_accepts_a_utf8_bom_at_the_start() -> None:
    """A byte order mark (Notepad, PowerShell) before the first line is skipped, not a bad first line."""
    data = b"\xef\xbb\xbf" + jsonl({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    lines = list(read_input(io.BytesIO(data), DEFAULTS))
    assert [(line.id, line.error) for line in lines] == [("a", ""), ("b", "")]


def test_read_input_cr_only_line_endings_are_an_error_that_says_so() -> None:
    """CR-only line endings read as one long line: the error names them and how to convert, not "bad JSON"."""
    data = jsonl({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}).replace(b"\n", b"\r")
    with pytest.raises(BatchInputError, match=r"CR-only line endings.*tr ") as caught:
        list(read_input(io.BytesIO(data), DEFAULTS, name="in.jsonl"))
    assert caught.value.line_number == 1 and "in.jsonl" in str(caught.value)
    crlf = jsonl({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}).replace(b"\n", b"\r\n")
    assert [line.id for line in read_input(io.BytesIO(crlf), DEFAULTS)] == ["a", "b"]  # Windows endings are fine


def test_id_key_keeps_int_and_str_ids_apart() -> None:
    """5 and "5" are different ids."""
    assert id_key(5) != id_key("5")


def test_count_lines_counts_a_last_line_without_newline(tmp_path: Path) -> None:
    """count_lines counts newline-terminated lines plus a trailing partial one."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\nb\nc")
    assert count_lines(str(path)) == 3
    path.write_bytes(b"")
    assert count_lines(str(path)) == 0


def test_prepare_output_missing_file_is_empty(tmp_path: Path) -> None:
    """No output file: nothing done, nothing written."""
    state = prepare_output(str(tmp_path / "out.jsonl"))
    assert state.done == set() and not state.rewritten
    assert not (tmp_path / "out.jsonl").exists()


def test_prepare_output_clean_file_is_not_rewritten(tmp_path: Path) -> None:
    """A file of answered ids is read, not rewritten."""
    path = tmp_path / "out.jsonl"
    write_lines(path, [{"id": "a", "sequences": []}, {"id": 2, "sequences": []}])
    inode = os.stat(path).st_ino
    state = prepare_output(str(path))
    assert state.done == {id_key("a"), id_key(2)}
    assert not state.rewritten and os.stat(path).st_ino == inode


def test_prepare_output_drops_error_lines_atomically(tmp_path: Path) -> None:
    """Failed ids are dropped by an atomic rewrite (a new file moved into place), so they run again."""
    path = tmp_path / "out.jsonl"
    write_lines(
        path, [{"id": "a", "sequences": []}, {"id": "b", "error": {"message": "x"}}, {"id": "c", "sequences": []}]
    )
    os.chmod(path, 0o640)
    inode = os.stat(path).st_ino
    state = prepare_output(str(path))
    assert state.rewritten and state.dropped_errors == 1
    assert state.done == {id_key("a"), id_key("c")}
    assert [r["id"] for r in read_records(path)] == ["a", "c"]
    assert os.stat(path).st_ino != inode  # replaced, not truncated in place
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == [".out.jsonl.lock", "out.jsonl"]  # no temporary left; the lock file stays


def test_prepare_output_keeps_error_lines_without_retry(tmp_path: Path) -> None:
    """With retry_failed=False failed ids stay as they are, and count as done."""
    path = tmp_path / "out.jsonl"
    write_lines(path, [{"id": "a", "sequences": []}, {"id": "b", "error": {"message": "x"}}])
    state = prepare_output(str(path), retry_failed=False)
    assert state.done == {id_key("a"), id_key("b")}
    assert state.kept_errors == 1 and not state.rewritten


def test_prepare_output_repairs_a_torn_last_line(tmp_path: Path) -> None:
    """A last line cut off by a kill is dropped; its id runs again."""
    path = tmp_path / "out.jsonl"
    write_lines(path, [{"id": "a", "sequences": []}], tail='{"id": "b", "seque')
    state = prepare_output(str(path))
    assert state.rewritten and state.dropped_torn == 1
    assert state.done == {id_key("a")}
    assert path.read_text(encoding="utf-8") == json.dumps({"id": "a", "sequences": []}) + "\n"


def test_prepare_output_drops_a_complete_json_without_newline(tmp_path: Path) -> None:
    """A last line without its newline is torn even if it parses, so nothing is appended to it."""
    path = tmp_path / "out.jsonl"
    write_lines(path, [{"id": "a", "sequences": []}], tail='{"id": "b", "sequences": []}')
    state = prepare_output(str(path))
    assert state.done == {id_key("a")}
    assert path.read_text(encoding="utf-8").endswith("\n")


def test_prepare_output_keeps_the_first_of_duplicate_ids(tmp_path: Path) -> None:
    """Duplicate ids in the output keep their first line only."""
    path = tmp_path / "out.jsonl"
    write_lines(path, [{"id": "a", "sequences": [1]}, {"id": "a", "sequences": [2]}])
    state = prepare_output(str(path))
    assert state.rewritten
    assert read_records(path) == [{"id": "a", "sequences": [1]}]


def test_remembered_settings_torn_by_a_kill_take_the_next_runs(tmp_path: Path) -> None:
    """``<output>.settings`` is appended to, never rewritten: a line a kill tore is ended and skipped by the next
    run, whose settings then count (glued to the torn line, they would be lost and the first run's refuse)."""
    path = str(tmp_path / "out.jsonl")
    first = PROMPT_LINES.settings(DEFAULTS, "m")
    second = {**first, "temperature": 0.0}
    with open_output(path, settings=first):
        pass  # killed before any answer, mid-way through a digest:
    with open(path + ".settings", "a", encoding="utf-8") as memory:
        memory.write('{"id": "\\"a\\"", "li')
    with open_output(path, settings=second) as (_, stream):  # nothing answered: other settings are taken
        write_record(stream, {"id": "a", "sequences": []})
    with open_output(path, settings=second) as (state, _):
        assert state.done == {id_key("a")}
    with pytest.raises(OutputSettingsError, match=r"temperature 0\.0 -> 0\.5"):
        with open_output(path, settings=first):
            pass


def test_a_bad_line_forgets_what_its_id_asked_before(tmp_path: Path) -> None:
    """A failed id run again as a bad line (no request) answers nothing: what its earlier record asked is forgotten,
    so a later run keeping that failure (retry_failed=False) takes the fixed line as it is, not as a changed one."""
    path = str(tmp_path / "out.jsonl")
    settings = PROMPT_LINES.settings(DEFAULTS, "m")
    asked, bad = parse_line(b'{"id": "a", "prompt": [5]}', 1, DEFAULTS), parse_line(b'{"id": "a"}', 1, DEFAULTS)
    fixed = parse_line(b'{"id": "a", "prompt": [6]}', 1, DEFAULTS)
    assert asked is not None and bad is not None and bad.request is None and fixed is not None
    for line, error in ((asked, ModelNotFoundError("gone")), (bad, bad.error)):  # the failure is run again
        with open_output(path, settings=settings) as (state, stream):
            assert state.memory is not None and not state.done
            state.memory.remember(line.key, line.request)
            write_record(stream, error_record(line, error))
    with open_output(path, settings=settings, retry_failed=False) as (state, _):
        assert state.memory is not None and state.done == {id_key("a")}
        assert state.memory.refusal(fixed) is None


def test_result_record_holds_sequences_and_no_nan() -> None:
    """An answer becomes id, model and sequences; a missing logprob is null, not NaN."""
    output = SampleOutput(
        (GeneratedSequence((5, 6), (-0.5, float("nan")), "length", "ab"),), prompt_logprobs=(None, -1.0), model="m"
    )
    record = result_record(InputLine(1, "a"), output)
    assert record == {
        "id": "a",
        "model": "m",
        "sequences": [{"tokens": [5, 6], "logprobs": [-0.5, None], "text": "ab", "stop_reason": "length"}],
        "prompt_logprobs": [None, -1.0],
    }
    stream = io.StringIO()
    write_record(stream, record)
    assert stream.getvalue().count("\n") == 1 and "NaN" not in stream.getvalue()


def test_error_record_holds_status_type_and_message() -> None:
    """A failure becomes an error object with status, type, message and line number."""
    error = ModelNotFoundError("no such model", status=404, model="m")
    record = error_record(InputLine(3, "x"), error, "m")
    assert record == {
        "id": "x",
        "model": "m",
        "error": {"status": 404, "type": "ModelNotFoundError", "message": "no such model", "line": 3},
    }
    bad = error_record(InputLine(4, 4), "not valid JSON")
    assert bad["error"]["message"] == "line 4: not valid JSON" and bad["error"]["status"] is None


def test_sample_request_round_trip_from_line() -> None:
    """A parsed line's request is a plain SampleRequest (usable with SamplerClient.run)."""
    line = parse_line(b'{"prompt": "hi", "stop": ["x", 7]}', 1, DEFAULTS)
    assert line is not None and isinstance(line.request, SampleRequest)
    assert line.request.sampling_params is not None
    assert line.request.sampling_params.stop == ("x", 7)
