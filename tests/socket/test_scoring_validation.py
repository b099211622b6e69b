"""Scoring refuses answers that cannot be right and never crashes on extreme valid ones (issue 27's scoring item).

A small loopback engine (``rawserver``) answers ``/v1/models``, ``/tokenize`` and ``/v1/completions`` with prompt
logprobs chosen per prompt: -1e308 twice (valid, the sum leaves the float range), another token list than the one
sent, +5.0, and a completion the tokenizer turns into no token. ``lora-sampler score`` writes a row for each line
(an error row for the impossible ones) and never a traceback; token ids of 10**30 are refused before any request.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Dict, List

import pytest
from rawserver import RawServer, json_response

from lora_sampler import ScoreOutput
from lora_sampler.cli import main

MODEL = "m"


def prompt_logprobs(ids: List[int], values: List[float]) -> List[Any]:
    """vLLM's prompt_logprobs for ``ids``: None first, then each token's own entry."""
    return [None] + [{str(t): {"logprob": v, "rank": 1, "decoded_token": "x"}} for t, v in zip(ids[1:], values)]


def answer_for(prompt: List[int]) -> Dict[str, Any]:
    """The completion answer for a prompt: its first id picks the case (see the module docstring)."""
    ids, values = list(prompt), [-0.5] * (len(prompt) - 1)
    if prompt[0] == 11:  # extreme but valid: two logprobs of -1e308
        values = [-1e308] * (len(prompt) - 1)
    elif prompt[0] == 12:  # the engine scored other tokens than those sent
        ids = [t + 1 for t in prompt]
    elif prompt[0] == 13:  # a log-probability above 0
        values = [5.0, *values[1:]]
    choice = {
        "index": 0,
        "text": "x",
        "token_ids": [5],
        "logprobs": {"token_logprobs": [-0.1], "tokens": ["x"], "text_offset": [0], "top_logprobs": [{"x": -0.1}]},
        "finish_reason": "length",
        "prompt_token_ids": ids,
        "prompt_logprobs": prompt_logprobs(ids, values),
    }
    return {"model": MODEL, "choices": [choice]}


class ScoringServer(RawServer):
    """A loopback engine for scoring: one base model, a tokenizer of one token per byte (none for spaces only)."""

    def __init__(self) -> None:
        super().__init__(self._answer)
        self.completions = 0

    def _answer(self, conn: socket.socket, index: int) -> None:
        raw = self.requests[-1]
        line = raw.split(b"\r\n", 1)[0].decode()
        body = json.loads(raw.split(b"\r\n\r\n", 1)[1] or b"null")
        if "/v1/models" in line:
            answer: Any = {"object": "list", "data": [{"id": MODEL, "root": MODEL, "parent": None}]}
        elif "/tokenize" in line:
            text = body["prompt"]
            tokens = [] if not text.strip() else [100 + b for b in text.encode()]
            answer = {"count": len(tokens), "max_model_len": 256, "tokens": tokens, "token_strs": None}
        elif "/health" in line:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        else:
            self.completions += 1
            answer = answer_for(body["prompt"])
        conn.sendall(json_response(json.dumps(answer).encode()))


@pytest.fixture
def server() -> Any:
    with ScoringServer() as running:
        yield running


def score(server: ScoringServer, tmp_path: Path, lines: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Run ``lora-sampler score`` over ``lines``; return its records by id."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    argv = ["score", "--base-url", server.url, "--base-model", MODEL, "--input", str(inp), "--output", str(out)]
    status = main([*argv, "--concurrency", "1", "--quiet", "--max-outage", "0", "--prompts-per-request", "1"])
    records = {record["id"]: record for record in map(json.loads, out.read_text().splitlines())}
    assert len(records) == len(lines)
    records["status"] = {"exit": status}
    return records


def test_score_extreme_valid_logprobs_give_a_row_not_a_traceback(server: ScoringServer, tmp_path: Path) -> None:
    """Two logprobs of -1e308 (their sum leaves the float range): every line gets its row, the sum is null."""
    lines = [{"id": "a", "prompt": [10, 6, 7]}, {"id": "b", "prompt": [11, 6, 7]}, {"id": "c", "prompt": [10, 8]}]
    records = score(server, tmp_path, lines)
    assert records["status"]["exit"] == 0
    assert records["b"]["logprobs"] == [-1e308, -1e308] and records["b"]["sum"] is None
    assert records["a"]["sum"] == -1.0 and records["c"]["sum"] == -0.5


def test_score_output_total_of_extreme_logprobs_is_minus_infinity() -> None:
    """ScoreOutput.total of two -1e308 is -inf (it raised OverflowError)."""
    assert ScoreOutput((1, 2, 3), (None, -1e308, -1e308), 1).total == float("-inf")


def test_score_refuses_prompt_token_ids_other_than_those_sent(server: ScoringServer, tmp_path: Path) -> None:
    """An answer whose prompt_token_ids are not the ids sent is an error row naming both, not other tokens' scores."""
    records = score(server, tmp_path, [{"id": "x", "prompt": [12, 6, 7]}, {"id": "ok", "prompt": [10, 6]}])
    assert records["status"]["exit"] == 1 and "sum" in records["ok"]
    assert "not the token ids sent" in records["x"]["error"]["message"]


def test_score_refuses_a_positive_logprob(server: ScoringServer, tmp_path: Path) -> None:
    """A prompt logprob of +5.0 is an error row (a log-probability is never above 0)."""
    records = score(server, tmp_path, [{"id": "x", "prompt": [13, 6, 7]}])
    assert records["status"]["exit"] == 1 and "never above 0" in records["x"]["error"]["message"]


def test_score_refuses_a_completion_of_no_token(server: ScoringServer, tmp_path: Path) -> None:
    """A completion the engine's tokenizer turns into no token is an error row, not a sum of 0.0."""
    records = score(server, tmp_path, [{"id": "x", "prompt": "Q:", "completion": "   "}])
    assert records["status"]["exit"] == 1 and "holds no token" in records["x"]["error"]["message"]
    assert server.completions == 0


def test_score_refuses_token_ids_beyond_32_bits_before_sending(server: ScoringServer, tmp_path: Path) -> None:
    """Token ids of 10**30 are an error row, and nothing is sent for them."""
    records = score(server, tmp_path, [{"id": "x", "prompt": [5, 10**30]}, {"id": "y", "prompt": [10, 2**31]}])
    assert records["status"]["exit"] == 1 and server.completions == 0
    for key in ("x", "y"):
        assert "below 2**31" in records[key]["error"]["message"]
