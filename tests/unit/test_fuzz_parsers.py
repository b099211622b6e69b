"""Fuzz targets, one per parser (hypothesis, a small example budget so the default test envs stay fast).

Each parser either returns its value or raises its documented error, whatever it is handed: input lines of both
formats, engine answers (completions and chat) and their JSON decoding, and tar member checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sampler._adapters.archive import check_member
from lora_sampler._adapters.extract import extract_archive
from lora_sampler._transport.translate import loads_strict
from lora_sampler.batch import LineDefaults, parse_line, to_json_line
from lora_sampler.errors import PublishError
from lora_sampler.openai_batch import parse_batch_line
from lora_sampler.types import SampleOutput, SampleRequest

#: Few examples each: these run in every default test env; a failure shrinks to its smallest input.
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
#: Keys the parsers look for, so examples reach past the first check.
KEYS = st.sampled_from(
    [
        *("id", "prompt", "messages", "custom_id", "method", "url", "body", "model", "choices", "index"),
        *("token_ids", "logprobs", "token_logprobs", "content", "logprob", "message", "prompt_logprobs"),
        *("prompt_token_ids", "n"),
    ]
)
SHAPED = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=24,
)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


LINES = st.one_of(st.binary(max_size=64), SHAPED.map(_json_bytes), JSON_VALUES.map(_json_bytes))


@FUZZ
@given(raw=LINES)
def test_fuzz_prompt_lines_never_raise(raw: bytes) -> None:
    """A prompt-format line is a request, an error row or blank; never an exception, and its row is writable."""
    line = parse_line(raw, 1, LineDefaults(base_model="m"))
    if line is not None:
        assert (line.request is None) == bool(line.error)
        to_json_line({"id": line.id, "error": line.error}).encode("utf-8")


@FUZZ
@given(raw=LINES)
def test_fuzz_batch_lines_never_raise(raw: bytes) -> None:
    """An OpenAI batch line is a request, an error row or blank; never an exception."""
    line = parse_batch_line(raw, 1, LineDefaults())
    if line is not None:
        assert (line.request is None) == bool(line.error)
        to_json_line({"custom_id": line.id, "error": line.error}).encode("utf-8")


@pytest.mark.parametrize(
    "request_",
    [
        SampleRequest([1, 2], base_model="m", prompt_logprobs=True, topk_prompt_logprobs=2),
        SampleRequest(messages=[{"role": "user", "content": "hi"}], base_model="m"),
    ],
    ids=["completions", "chat"],
)
@FUZZ
@given(body=SHAPED)
def test_fuzz_answers_are_a_result_or_a_value_error(request_: SampleRequest, body: Any) -> None:
    """Any decoded answer is a SampleOutput or a ValueError (the transport's EngineProtocolError); nothing else."""
    try:
        output = SampleOutput.from_json(body, request_)
    except ValueError:
        return
    to_json_line({"sequences": [list(s.logprobs) for s in output.sequences]})


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), JSON_VALUES.map(_json_bytes), st.just(b"[" * 50_000)))
def test_fuzz_answer_bodies_decode_or_raise_value_error(raw: bytes) -> None:
    """An answer body decodes strictly or is a ValueError: no RecursionError, no NaN or Infinity value."""
    try:
        value = loads_strict(raw)
    except ValueError:
        return
    json.dumps(value, allow_nan=False)


@FUZZ
@given(
    name=st.text(max_size=20),
    kind=st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE]),
    link=st.text(max_size=10),
)
def test_fuzz_tar_member_checks_accept_or_refuse(name: str, kind: bytes, link: str) -> None:
    """A member is a relative path inside the folder or an UnsafeArchiveError; nothing else."""
    member = tarfile.TarInfo(name)
    member.type, member.linkname = kind, link
    try:
        rel = check_member(member, "a.tar")
    except PublishError:
        return
    assert rel is None or (not rel.startswith("/") and ".." not in rel.split("/"))


@FUZZ
@given(blocks=st.lists(st.binary(min_size=512, max_size=512), min_size=1, max_size=4))
def test_fuzz_tar_streams_extract_or_raise_publish_error(tmp_path_factory: Any, blocks: Any) -> None:
    """Random 512-byte blocks (headers or not) extract or raise PublishError, never anything else."""
    folder = tmp_path_factory.mktemp("fuzz")
    archive = folder / "a.tar"
    archive.write_bytes(b"".join(blocks))
    dest = folder / "out"
    dest.mkdir()
    with contextlib.suppress(PublishError):
        extract_archive(str(archive), str(dest), durable=False)


def test_fuzz_tar_header_with_a_valid_checksum_reaches_the_header_bound() -> None:
    """A real header block whose claimed PAX size is huge takes the bound's path (the fuzz above rarely builds one)."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, 1 << 33
    block = info.tobuf(format=tarfile.GNU_FORMAT)
    assert len(block) == 512 and block[156:157] == b"x"
    with pytest.raises(PublishError, match="max_header_bytes"):
        _extract_bytes(block + b"\0" * 1024)


def _extract_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "a.tar")
        with open(path, "wb") as f:
            f.write(data)
        os.mkdir(os.path.join(folder, "out"))
        extract_archive(path, os.path.join(folder, "out"), durable=False)
