"""Scoring end to end on loopback: ``compute_logprobs``, ``ScoreRequest`` fan-out, FakeEngine's ``/tokenize``, and
``lora-sampler score`` (resume, exit status, outages) against FakeEngine.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import requests

from lora_sampler import EngineConnectionError, ModelNotFoundError, RetryPolicy, SamplerClient, ScoreRequest
from lora_sampler._wire.routes import COMPLETIONS_PATH, LOAD_ADAPTER_PATH, TOKENIZE_PATH
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)


def read_records(path: Path) -> Dict[Any, Dict[str, Any]]:
    """The records of an output file by id; every line must be complete JSON and ids unique."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = {record["id"]: record for record in map(json.loads, lines)}
    assert len(found) == len(lines)
    return found


def test_compute_logprobs_one_per_token_none_first(engine: FakeEngine) -> None:
    """Token ids and text give one logprob per prompt token, None first, equal to sample(prompt_logprobs=True)."""
    with SamplerClient(engine.url) as client:
        by_ids = client.compute_logprobs([5, 6, 7, 8], base_model=engine.model)
        by_text = client.compute_logprobs("Hello", base_model=engine.model)
        sampled = client.sample([5, 6, 7, 8], base_model=engine.model, prompt_logprobs=True)
    assert by_ids[0] is None and len(by_ids) == 4 and all(isinstance(lp, float) for lp in by_ids[1:])
    assert by_ids == sampled.prompt_logprobs
    assert len(by_text) == len("Hello") and by_text[0] is None  # the fake's tokenizer: one token per byte


def test_compute_logprobs_differ_by_adapter_deterministically(engine: FakeEngine, lora_dir: Path) -> None:
    """Each adapter has its own logprobs, the same on every call; the base model's differ from both."""
    write_adapter(lora_dir / "alpha", engine.model)
    write_adapter(lora_dir / "beta", engine.model)
    prompt = [5, 6, 7, 8, 9]
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        base = client.compute_logprobs(prompt, base_model=engine.model)
        alpha = client.compute_logprobs(prompt, adapter="alpha")
        beta = client.compute_logprobs(prompt, adapter="beta")
        assert client.compute_logprobs(prompt, adapter="alpha") == alpha
    assert len({base, alpha, beta}) == 3


def test_score_request_completion_equals_slice_of_the_whole(engine: FakeEngine) -> None:
    """A completion's logprobs given the prompt are those of the same tokens in the whole sequence (text or ids)."""
    with SamplerClient(engine.url) as client:
        whole = client.compute_logprobs("Hello world", base_model=engine.model)
        by_text, by_ids = client.sample_many(
            [
                ScoreRequest("Hello", completion=" world", base_model=engine.model),
                ScoreRequest([4 + b for b in b"Hello"], completion=[4 + b for b in b" world"], base_model=engine.model),
            ]
        )
    for output in (by_text, by_ids):
        assert output.start == 5 and output.scored_tokens == tuple(4 + b for b in b" world")
        assert output.scored_logprobs == whole[5:] and output.total == pytest.approx(sum(whole[5:]))  # type: ignore
    assert engine.calls(TOKENIZE_PATH) == 2  # prompt and completion texts, each once; ids need no tokenizer


def test_fake_engine_tokenize_speaks_vllm_shape(engine: FakeEngine) -> None:
    """POST /tokenize answers vLLM's TokenizeResponse with the sampler's tokens; an unknown model is vLLM's 404."""
    answer = requests.post(engine.url + TOKENIZE_PATH, json={"model": engine.model, "prompt": "Hi"}, timeout=5)
    assert answer.status_code == 200
    assert answer.json() == {"count": 2, "max_model_len": 256, "tokens": [4 + 72, 4 + 105], "token_strs": None}
    missing = requests.post(engine.url + TOKENIZE_PATH, json={"model": "ghost", "prompt": "Hi"}, timeout=5)
    assert missing.status_code == 404 and "The model `ghost` does not exist" in missing.text


def test_fake_engine_prompt_logprobs_do_not_depend_on_k(engine: FakeEngine) -> None:
    """A token's own logprob is the same whatever top-k is asked (0, 5, 20); the prompt token comes first."""
    with SamplerClient(engine.url) as client:
        runs = [
            client.sample([5, 6, 7, 8, 9], base_model=engine.model, prompt_logprobs=True, topk_prompt_logprobs=k)
            for k in (0, 5, 20)
        ]
    assert runs[0].prompt_logprobs == runs[1].prompt_logprobs == runs[2].prompt_logprobs
    entries = (runs[2].body or {})["choices"][0]["prompt_logprobs"]
    assert [next(iter(entry)) for entry in entries[1:]] == ["6", "7", "8", "9"]  # vLLM's order: the token's own first
    assert all(len(entry) in (20, 21) for entry in entries[1:])


def test_compute_logprobs_rides_out_the_adapter_race(engine: FakeEngine, lora_dir: Path) -> None:
    """An adapter not visible yet is retried with a proactive load, as sample is (see docs/guides/retries.md)."""
    write_adapter(lora_dir / "late", engine.model)
    engine.set_visibility_delay("late", requests=2)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, retry=FAST) as client:
        logprobs = client.compute_logprobs([5, 6, 7], adapter="late")
    assert len(logprobs) == 3
    assert engine.calls(COMPLETIONS_PATH, model="late") >= 3 and engine.calls(LOAD_ADAPTER_PATH) >= 1


def test_compute_logprobs_base_model_404_raises_at_once(engine: FakeEngine) -> None:
    """A base-model name the engine does not serve is raised after one request (no retries)."""
    with SamplerClient(engine.url, retry=FAST) as client:
        with pytest.raises(ModelNotFoundError):
            client.compute_logprobs([5, 6], base_model="ghost")
    assert engine.calls(COMPLETIONS_PATH) == 1


def test_score_tokenize_is_retried_on_transport_errors(engine: FakeEngine) -> None:
    """A dropped /tokenize connection is retried under the policy, then scoring goes on."""
    engine.inject_fault("drop", path=TOKENIZE_PATH, count=2)
    with SamplerClient(engine.url, retry=FAST) as client:
        (output,) = client.sample_many([ScoreRequest("ab", completion="c", base_model=engine.model)])
    assert output.scored_tokens == (4 + ord("c"),)
    assert engine.calls(TOKENIZE_PATH) == 4  # two dropped, then the prompt and the completion


def test_score_fan_out_waits_out_an_outage(make_engine: Any, lora_dir: Path) -> None:
    """imap with max_outage holds ScoreRequests while the engine is down and scores them once it is back.

    The engine restarts once the client says it holds requests (its on_outage hook), whatever the machine's speed."""
    first = make_engine()
    port, model = first.port, first.model
    first.stop()
    restarted: List[FakeEngine] = []
    held = threading.Event()

    def restart() -> None:
        try:
            assert held.wait(60), "the client never held a request"
        finally:  # restarted even so: imap ends, and the assertions say what went wrong
            restarted.append(make_engine(port=port))

    def on_outage(event: Any) -> None:
        if event.kind == "held":
            held.set()

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        with SamplerClient(f"http://127.0.0.1:{port}", retry=FAST, max_workers=2) as client:
            scores = [ScoreRequest([5, 6, i + 7], base_model=model) for i in range(4)]
            outputs = list(client.imap(scores, max_outage=20, on_outage=on_outage))
    finally:
        thread.join()
    assert [o.tokens[-1] for o in outputs] == [7, 8, 9, 10]
    with pytest.raises(EngineConnectionError):  # and without max_outage the same outage fails
        restarted[0].stop()
        with SamplerClient(f"http://127.0.0.1:{port}", retry=FAST) as client:
            client.compute_logprobs([5, 6], base_model=model)


# -- lora-sampler score ----------------------------------------------------------------------------------------------


def score_args(engine: FakeEngine, inp: Path, out: Path, *more: str) -> List[str]:
    """The argv of a quiet ``score`` run against ``engine``'s base model unless ``more`` says otherwise."""
    which = [] if "--adapter" in more else ["--base-model", engine.model]
    return ["score", "--base-url", engine.url, *which, "--input", str(inp), "--output", str(out), "--quiet", *more]


def test_cli_score_writes_scored_tokens_logprobs_and_sum(engine: FakeEngine, tmp_path: Path) -> None:
    """Token-id and text lines, with and without completion, give the scored tokens, their logprobs and the sum."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "ids", "prompt": [5, 6, 7, 8]},
        {"id": "text", "prompt": "Hello", "completion": " world"},
        {"id": 3, "prompt": [5, 6], "completion": "xy"},
    ]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert main(score_args(engine, inp, out)) == 0
    records = read_records(out)
    with SamplerClient(engine.url) as client:
        whole = client.compute_logprobs([5, 6, 7, 8], base_model=engine.model)
        text = client.compute_logprobs("Hello world", base_model=engine.model)
    assert records["ids"] == {
        "id": "ids",
        "model": engine.model,
        "tokens": [6, 7, 8],
        "logprobs": list(whole[1:]),
        "sum": pytest.approx(sum(whole[1:])),  # type: ignore[arg-type]
    }
    assert records["text"]["tokens"] == [4 + b for b in b" world"] and records["text"]["logprobs"] == list(text[5:])
    assert records[3]["tokens"] == [4 + ord("x"), 4 + ord("y")]


def test_cli_score_adapter_checkpoint_differs_from_base(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """--adapter CKPT publishes the checkpoint and scores under it: its sums are not the base model's."""
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
    inp, base_out, adapter_out = tmp_path / "in.jsonl", tmp_path / "base.jsonl", tmp_path / "adapter.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [5, 6, 7 + i]}) + "\n" for i in range(5)), encoding="utf-8")
    assert main(score_args(engine, inp, base_out)) == 0
    assert main(score_args(engine, inp, adapter_out, "--lora-base-dir", str(lora_dir), "--adapter", archive)) == 0
    base, adapted = read_records(base_out), read_records(adapter_out)
    assert {r["model"] for r in adapted.values()} != {engine.model}
    assert all(base[i]["tokens"] == adapted[i]["tokens"] and base[i]["sum"] != adapted[i]["sum"] for i in range(5))


def test_cli_score_bad_lines_exit_1_and_resume_runs_them_again(engine: FakeEngine, tmp_path: Path) -> None:
    """Bad lines are error records (exit 1); once fixed, a resume scores only them, one line per id in the end."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = [json.dumps({"id": f"g{i}", "prompt": [5, 6, 7 + i]}) for i in range(6)]
    inp.write_text("\n".join([*good, '{"id": "bad", "prompt": [5, -1]}', '{"id": "chat", "messages": []}']) + "\n")
    assert main(score_args(engine, inp, out)) == 1
    first = read_records(out)
    assert "error" in first["bad"] and "token ids must be >= 0" in first["bad"]["error"]["message"]
    assert "chat messages are not scored" in first["chat"]["error"]["message"]
    engine.reset_log()
    fixed = [*good, '{"id": "bad", "prompt": [5, 1]}', '{"id": "chat", "prompt": "x", "completion": "y"}']
    inp.write_text("\n".join(fixed) + "\n")
    assert main(score_args(engine, inp, out)) == 0
    second = read_records(out)
    assert sorted(second) == sorted(first) and all("sum" in record for record in second.values())
    assert second["g0"] == first["g0"] and engine.calls(COMPLETIONS_PATH) == 2  # only the two fixed lines ran


def test_cli_score_unusable_engine_exits_2(tmp_path: Path) -> None:
    """No engine at --base-url is exit 2 before anything is written."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 1, "prompt": [5, 6]}\n')
    argv = ["score", "--base-url", "http://127.0.0.1:9", "--base-model", "m", "--input", str(inp), "--output", str(out)]
    assert main([*argv, "--quiet", "--timeout", "1,1"]) == 2
    assert not out.exists() or out.read_text() == ""


def test_cli_score_needs_adapter_or_base_model(engine: FakeEngine, tmp_path: Path) -> None:
    """Without --adapter or --base-model the command is a usage error (exit 2)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": [5, 6]}\n')
    assert main(["score", "--base-url", engine.url, "--input", str(inp)]) == 2


def test_docs_scoring_example_runs_as_written(capsys: Any) -> None:
    """The scoring guide's first example runs on FakeEngine as written: 11 logprobs for 11 bytes, two scored lines."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "scoring.md").read_text(encoding="utf-8")
    block = guide.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/guides/scoring.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[0].startswith("11 None -")
    assert printed[1].startswith("(36, 56) [") and printed[2].startswith("(36, 57) [")  # " 4", " 5": 4 + byte
