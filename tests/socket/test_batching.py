"""Many prompts per request: requests sharing a model and settings go as one ``/v1/completions`` with a prompt list.

Every guarantee stays per prompt: input order, errors (a 400 for the whole request is split until only the bad
prompt has it), the adapter-load race, Ctrl-C, resume, progress, and imap's read-ahead counted in prompts. Most
cases run against a FakeEngine on loopback; the engine that mixes up its answers is a small server of its own.
"""

from __future__ import annotations

import http.server
import json
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest
from test_cli import WAIT_SECONDS, cli_mid_run, ids, main, records, sample_args, write_prompts
from test_interrupts import HANG_SECONDS, STOP_SECONDS, mid_run, sigint_when, wait_until

from lora_sampler import (
    SampleOutput,
    SamplerClient,
    SampleRequest,
    SamplingInterruptedError,
    SamplingParams,
    ScoreOutput,
    ScoreRequest,
)
from lora_sampler.errors import BadRequestError, EngineStatusError
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

COMPLETIONS = "/v1/completions"


def completions(engine: FakeEngine) -> List[Any]:
    """The engine's completion requests so far (each knows how many prompts it held)."""
    return [record for record in engine.requests if record.path == COMPLETIONS]


def prompts_sent(engine: FakeEngine) -> int:
    return sum(record.prompts for record in completions(engine) if record.status == 200)


def token_prompts(count: int, base: int = 5) -> List[List[int]]:
    return [[base + i % 200, 6 + i % 3, 7] for i in range(count)]


# -- the reproduction: one request per prompt --------------------------------------------------------------


def test_sample_many_sends_many_prompts_per_request_by_default(engine: FakeEngine) -> None:
    """256 short generations go as a few requests of up to 32 prompts (a1a82fa sent 256 requests), in input order."""
    prompts = token_prompts(256)
    with SamplerClient(engine.url, max_workers=4) as client:
        outputs = client.sample_many([{"prompt": p, "base_model": engine.model, "max_tokens": 4} for p in prompts])
    sent = completions(engine)
    assert sum(r.prompts for r in sent) == 256 and len(sent) <= 256 // 8 and max(r.prompts for r in sent) <= 32
    assert [list(o.body["choices"][0]["prompt_token_ids"]) for o in outputs] == prompts  # each its own answer


def test_batched_answers_equal_one_prompt_per_request(engine: FakeEngine) -> None:
    """Greedy samples and scores are the same batched or not; prompts_per_request=1 keeps one prompt per request."""
    prompts = token_prompts(40)
    requests = [SampleRequest(p, base_model=engine.model, sampling_params=None, num_samples=1) for p in prompts]
    scores = [ScoreRequest(p, base_model=engine.model) for p in prompts]
    with SamplerClient(engine.url, max_workers=3) as client:
        greedy_params = {"temperature": 0.0, "max_tokens": 5}
        batched = client.sample_many([{"prompt": p, "base_model": engine.model, **greedy_params} for p in prompts])
        scored = client.sample_many(scores, prompts_per_request=7)
        engine.reset_log()
        alone = client.sample_many(
            [{"prompt": p, "base_model": engine.model, **greedy_params} for p in prompts], prompts_per_request=1
        )
        scored_alone = client.sample_many(scores, prompts_per_request=1)
        assert [r.prompts for r in completions(engine)] == [1] * 80
        assert len(client.sample_many(requests)) == 40
    assert [o.sequences for o in batched] == [o.sequences for o in alone]
    assert scored == scored_alone and all(isinstance(s, ScoreOutput) for s in scored)


def test_usage_of_each_output_counts_its_own_prompt(engine: FakeEngine) -> None:
    """vLLM's usage sums the request; each output's usage counts its own tokens, the sum stays in request_usage."""
    prompts = [[5] * 3, [6] * 5, [7] * 2]
    with SamplerClient(engine.url, max_workers=1) as client:
        outputs = client.sample_many(
            [{"prompt": p, "base_model": engine.model, "max_tokens": 4, "num_samples": 2} for p in prompts],
            prompts_per_request=3,
        )
    for prompt, output in zip(prompts, outputs):
        generated = sum(len(s.tokens) for s in output.sequences)
        assert output.usage is not None and output.usage.prompt_tokens == len(prompt)
        assert output.usage.completion_tokens == generated == 8
        assert output.to_dict()["usage"]["total_tokens"] == 8 + len(prompt)
        assert [c["index"] for c in output.body["choices"]] == [0, 1]
    by_request: Dict[str, List[SampleOutput]] = {}
    for output in outputs:
        by_request.setdefault(output.body["id"], []).append(output)
    for shared in by_request.values():  # the outputs of one request carry its summed usage as request_usage
        if "request_usage" not in shared[0].body:  # a request that held one prompt: its usage is the request's
            assert len(shared) == 1
            continue
        request_usage = shared[0].body["request_usage"]
        assert all(o.body["request_usage"] == request_usage for o in shared)
        assert request_usage["prompt_tokens"] == sum(o.usage.prompt_tokens for o in shared if o.usage)
        assert request_usage["completion_tokens"] == 8 * len(shared)


# -- errors per prompt ------------------------------------------------------------------------------------------------


def test_a_400_for_the_whole_request_errs_only_the_bad_prompt(make_engine: Callable[..., FakeEngine]) -> None:
    """One over-long prompt in 32: the request is split in halves until only that prompt gets the 400."""
    engine = make_engine(max_model_len=16)
    prompts: List[List[int]] = token_prompts(32)
    prompts[19] = [5] * 40
    with SamplerClient(engine.url, max_workers=1) as client:
        results = client.sample_many(
            [{"prompt": p, "base_model": engine.model, "max_tokens": 2} for p in prompts],
            return_exceptions=True,
            prompts_per_request=32,
        )
    bad = [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)]
    assert bad == [19] and isinstance(results[19], BadRequestError) and "maximum context length" in str(results[19])
    assert [r.body["choices"][0]["prompt_token_ids"] for i, r in enumerate(results) if i != 19] == [
        p for i, p in enumerate(prompts) if i != 19
    ]
    # How the 32 prompts are grouped at first varies with the machine's speed (a first batch may go before it fills),
    # so the cost is counted where it cannot vary: each good prompt is answered exactly once, and only the requests
    # holding the bad prompt are refused: its batch, the rest after the first prompt went alone, one per halving.
    assert prompts_sent(engine) == 31
    assert sum(1 for record in completions(engine) if record.status == 400) <= 2 + 5 + 1


def test_a_bad_parameter_for_every_prompt_errs_each_prompt(make_engine: Callable[..., FakeEngine]) -> None:
    """A 400 that concerns every prompt (max_tokens over the context) reaches each of them, none answered."""
    engine = make_engine(max_model_len=16)
    with SamplerClient(engine.url, max_workers=2) as client:
        results = client.sample_many(
            [{"prompt": p, "base_model": engine.model, "max_tokens": 100} for p in token_prompts(8)],
            return_exceptions=True,
        )
    assert all(isinstance(r, BadRequestError) and "max_tokens" in str(r) for r in results)


def test_a_500_fails_each_prompt_of_its_request_and_the_others_go_on(engine: FakeEngine) -> None:
    """A request refused as a whole (500) gives its prompt the error once it holds one prompt (a batch's 500 is
    split: tests/socket/test_confined_failures.py); other requests are answered."""
    engine.inject_fault("status", status=500, count=1, message="scripted engine failure")
    with SamplerClient(engine.url, max_workers=1) as client:
        results = client.sample_many(
            [{"prompt": p, "base_model": engine.model, "max_tokens": 2} for p in token_prompts(24)],
            return_exceptions=True,
            prompts_per_request=8,
        )
    failed = [i for i, r in enumerate(results) if isinstance(r, EngineStatusError)]
    assert completions(engine)[0].status == 500 and failed == list(range(len(failed)))  # the first request's
    assert all(r.status == 500 for r in results[: len(failed)])
    assert all(isinstance(r, SampleOutput) for r in results[len(failed) :])


def test_prompts_per_request_out_of_range_is_refused_before_any_request(engine: FakeEngine) -> None:
    with SamplerClient(engine.url) as client:
        for bad in (0, -1, 1025, 10**9, True, 2.0, "8"):
            with pytest.raises(ValueError, match="prompts_per_request must be"):
                client.sample_many([{"prompt": [5], "base_model": engine.model}], prompts_per_request=bad)
            with pytest.raises(ValueError, match="prompts_per_request must be"):
                client.imap([], prompts_per_request=bad)
            with pytest.raises(ValueError, match="prompts_per_request must be"):
                client.imap_unordered([], prompts_per_request=bad)
        assert len(client.sample_many([{"prompt": [5], "base_model": engine.model}], prompts_per_request=1024)) == 1
    assert len(completions(engine)) == 1


# -- what goes together, and what never does ------------------------------------------------------------------------


def test_only_requests_of_one_model_and_settings_share_a_request(engine: FakeEngine, lora_dir: Path) -> None:
    """Mixed models, settings, n, text and token prompts, and chat: each request holds one kind; order is kept."""
    write_adapter(lora_dir / "ad-a", engine.model)
    kinds: List[Dict[str, Any]] = [
        {"base_model": engine.model, "max_tokens": 3},
        {"adapter": "ad-a", "max_tokens": 3},
        {"base_model": engine.model, "max_tokens": 4},
        {"base_model": engine.model, "max_tokens": 3, "num_samples": 3},
        {"base_model": engine.model, "max_tokens": 3, "text": True},
        {"base_model": engine.model, "max_tokens": 3, "chat": True},
    ]
    rng = random.Random(7)
    plan = [rng.randrange(len(kinds)) for _ in range(120)]
    requests = []
    for i, kind in enumerate(plan):
        fields = dict(kinds[kind])
        text, chat = fields.pop("text", False), fields.pop("chat", False)
        if chat:
            requests.append({"messages": [{"role": "user", "content": f"m{i}"}], **fields})
        else:
            requests.append({"prompt": f"t{i}" if text else [5 + i, 6], **fields})
    with SamplerClient(engine.url, lora_base_dir=str(lora_dir), max_workers=3) as client:
        outputs = client.sample_many(requests, prompts_per_request=16)
    for i, (kind, output) in enumerate(zip(plan, outputs)):
        assert output.model == ("ad-a" if kind == 1 else engine.model)
        assert len(output.sequences) == (3 if kind == 3 else 1)
        assert all(len(s.tokens) == (4 if kind == 2 else 3) for s in output.sequences)
        if kind in (0, 1, 2, 3):
            assert output.body["choices"][0]["prompt_token_ids"] == [5 + i, 6]
    chats = [r for r in engine.requests if r.path == "/v1/chat/completions"]
    assert len(chats) == plan.count(5) and all(r.prompts == 1 for r in chats)
    assert any(r.prompts > 1 for r in completions(engine))


def test_duplicate_prompts_and_n_greater_than_one_in_one_request(engine: FakeEngine) -> None:
    """The same prompt many times in one request, n=4 each: every slot gets its own four samples."""
    with SamplerClient(engine.url, max_workers=1) as client:
        outputs = client.sample_many(
            [{"prompt": [9, 9, 9], "base_model": engine.model, "max_tokens": 2, "num_samples": 4}] * 20,
            prompts_per_request=20,
        )
    assert [r.prompts for r in completions(engine)][-1] >= 2
    assert all(len(o.sequences) == 4 for o in outputs)
    samples = [s.tokens for o in outputs for s in o.sequences]
    assert len(set(samples)) > 40  # unseeded: the samples of the 20 copies are not one answer repeated


def test_scoring_batches_text_completions_after_tokenizing_each(engine: FakeEngine) -> None:
    """ScoreRequests with text completions are tokenized one by one, then scored as one request; order kept."""
    requests = [ScoreRequest(f"q{i}:", completion=f" a{i}", base_model=engine.model) for i in range(12)]
    with SamplerClient(engine.url, max_workers=1) as client:
        batched = client.sample_many(requests, prompts_per_request=12)
        alone = client.sample_many(requests, prompts_per_request=1)
    assert batched == alone
    assert [o.total for o in batched] == [o.total for o in alone]
    assert max(r.prompts for r in completions(engine)) > 1


# -- the engine mixes up its answers -----------------------------------------------------------------------------------


class _MixedUpEngine(http.server.ThreadingHTTPServer):
    """Answers prompt lists as vLLM does, then spoils the answer as ``mode`` says."""

    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _MixedUpHandler)
        self.mode = mode


class _MixedUpHandler(http.server.BaseHTTPRequestHandler):
    server: _MixedUpEngine

    def log_message(self, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = payload["prompt"] if isinstance(payload["prompt"][0], list) else [payload["prompt"]]
        choices = []
        for prompt in prompts:
            for _ in range(payload["n"]):
                choices.append(
                    {
                        "index": len(choices),
                        "text": "x",
                        "token_ids": [prompt[0]],
                        "logprobs": {"token_logprobs": [-0.5]},
                        "finish_reason": "length",
                        "prompt_token_ids": prompt,
                    }
                )
        mode = self.server.mode
        if mode == "reversed" and len(prompts) > 1:
            choices.reverse()  # listed backwards, each with its own index: still usable
        elif mode == "too-few" and len(prompts) > 1:
            choices.pop()
        elif mode == "swapped" and len(prompts) > 1:
            choices[0]["index"], choices[-1]["index"] = choices[-1]["index"], choices[0]["index"]
        elif mode == "doubled-index" and len(prompts) > 1:
            choices[1]["index"] = choices[0]["index"]
        body = json.dumps({"model": payload["model"], "choices": choices, "usage": None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def mixed_up() -> Iterator[Callable[[str], str]]:
    servers: List[_MixedUpEngine] = []

    def start(mode: str) -> str:
        server = _MixedUpEngine(mode)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_choices_listed_out_of_order_are_matched_by_index(mixed_up: Callable[[str], str]) -> None:
    with SamplerClient(mixed_up("reversed"), max_workers=1) as client:
        outputs = client.sample_many(
            [SampleRequest([100 + i, 1], base_model="m", num_samples=2) for i in range(10)], prompts_per_request=10
        )
    assert [[s.tokens for s in o.sequences] for o in outputs] == [[(100 + i,), (100 + i,)] for i in range(10)]


@pytest.mark.parametrize("mode", ["too-few", "swapped", "doubled-index"])
def test_an_answer_that_cannot_be_matched_to_its_prompts_is_refused(mode: str, mixed_up: Callable[[str], str]) -> None:
    """Too few choices, choices under another prompt's index, an index twice: the answer is refused and its prompts
    are sent again in smaller requests, down to one prompt a request: each gets its own answer, none is misplaced."""
    with SamplerClient(mixed_up(mode), max_workers=1) as client:
        results = client.sample_many(
            [SampleRequest([100 + i, 1], base_model="m") for i in range(6)],
            prompts_per_request=6,
            return_exceptions=True,
        )
    assert [r.sequences[0].tokens for r in results] == [(100 + i,) for i in range(6)]


# -- the race, Ctrl-C, read-ahead -------------------------------------------------------------------------------------


def test_the_adapter_race_retries_the_batched_request(engine: FakeEngine, lora_dir: Path, no_waits: None) -> None:
    """A fresh adapter the engine sees late: the batched request gets 404s, is retried whole, every prompt answered."""
    write_adapter(lora_dir / "late", engine.model)
    engine.set_visibility_delay("late", requests=2)
    with SamplerClient(engine.url, lora_base_dir=str(lora_dir), max_workers=2) as client:
        outputs = client.sample_many(
            [{"prompt": p, "adapter": "late", "max_tokens": 2} for p in token_prompts(64)], prompts_per_request=32
        )
    assert [o.body["choices"][0]["prompt_token_ids"] for o in outputs] == token_prompts(64)
    statuses = [(r.status, r.prompts) for r in completions(engine) if r.model == "late"]
    assert any(status == 404 for status, _ in statuses)
    assert sum(prompts for status, prompts in statuses if status == 200) == 64


@pytest.mark.parametrize(("workers", "per_request", "taken"), [(4, 16, 2000), (8, 1, 300)])
def test_imap_reads_ahead_a_bounded_number_of_prompts(
    engine: FakeEngine, workers: int, per_request: int, taken: int
) -> None:
    """imap over 100,000 prompts pulls at most 2 x max_workers x prompts_per_request ahead of what it yielded,
    batched or one prompt a request."""
    pulled = 0

    def requests() -> Iterator[SampleRequest]:
        nonlocal pulled
        for i in range(100_000):
            pulled += 1
            yield SampleRequest([i % 1000 + 1], base_model=engine.model, sampling_params=SamplingParams(max_tokens=1))

    ahead: List[int] = []
    with SamplerClient(engine.url, max_workers=workers) as client:
        results = client.imap(requests(), prompts_per_request=per_request)
        for count, _ in enumerate(results, 1):
            ahead.append(pulled - count)
            if count == taken:
                break
        results.close()
    bound = 2 * workers * per_request
    assert max(ahead) <= bound and pulled < taken + bound + 1
    assert max(r.prompts for r in completions(engine)) == per_request


def test_imap_unordered_batched_yields_each_index_once(engine: FakeEngine) -> None:
    prompts = token_prompts(300)
    with SamplerClient(engine.url, max_workers=3) as client:
        pairs = list(client.imap_unordered({"prompt": p, "base_model": engine.model} for p in prompts))
    assert sorted(index for index, _ in pairs) == list(range(300))
    assert all(out.body["choices"][0]["prompt_token_ids"] == prompts[index] for index, out in pairs)


def test_interrupt_imap_unordered_batched_stops_at_once(engine: FakeEngine) -> None:
    """Ctrl-C while imap_unordered waits on batched requests: control back at once, the engine aborts them."""
    engine.hold()
    with SamplerClient(engine.url, max_workers=2) as client:
        pairs = client.imap_unordered({"prompt": p, "base_model": engine.model} for p in token_prompts(500))
        with sigint_when(lambda: engine.wait_for_held(2, timeout=HANG_SECONDS)), pytest.raises(KeyboardInterrupt):
            next(pairs)
        interrupted = time.monotonic()
        assert wait_until(lambda: engine.requests_in_flight == 0) and engine.aborted_requests == 2
        assert time.monotonic() - interrupted < STOP_SECONDS
        engine.release()
        assert client.sample([5], base_model=engine.model).model == engine.model


def test_interrupt_keeps_the_answers_of_finished_batches(engine: FakeEngine) -> None:
    """Ctrl-C in a batched sample_many: .results holds every prompt of the batches that finished, in order."""
    with SamplerClient(engine.url, max_workers=2) as client:
        with sigint_when(mid_run(engine, answered=1, held=2)), pytest.raises(SamplingInterruptedError) as info:
            client.sample_many({"prompt": p, "base_model": engine.model} for p in token_prompts(20000))
    results = info.value.results
    answered = [i for i, r in enumerate(results) if r is not None]
    assert answered and all(isinstance(results[i], SampleOutput) for i in answered)
    assert all(results[i].body["choices"][0]["prompt_token_ids"] == token_prompts(20000)[i] for i in answered)
    assert wait_until(lambda: engine.requests_in_flight == 0)


# -- the CLI ---------------------------------------------------------------------------------------------------------


def test_cli_prompts_per_request_flag(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    archive = write_adapter_archive(str(tmp_path / "step-1.tar.gz"), engine.model)
    inp, out = write_prompts(tmp_path / "in.jsonl", 100), tmp_path / "out.jsonl"
    assert main(sample_args(engine, lora_dir, archive, inp, out, "--prompts-per-request", "10")) == 0
    assert sorted(ids(out)) == sorted(f"p{n}" for n in range(1, 101))
    answered = [r for r in completions(engine) if r.status == 200]
    assert sum(r.prompts for r in answered) == 100 and 1 < max(r.prompts for r in answered) <= 10
    for bad in ("0", "-1", "1025"):
        assert main(sample_args(engine, lora_dir, archive, inp, out, "--prompts-per-request", bad)) == 2


def test_cli_sigkill_mid_batch_then_resume_writes_each_line_once(lora_dir: Path, tmp_path: Path) -> None:
    """A batched job SIGKILLed mid-run, with a torn last line, resumes to exactly one answered line per id."""
    count = 2000
    # 40 requests of 1 to 16 prompts answered (40 to 640 lines), the rest wait: mid-run
    with cli_mid_run(lora_dir, tmp_path, count, answered=40, workers=2, per_request=16) as (engine, args, out, proc):
        proc.kill()
        proc.wait(timeout=WAIT_SECONDS)
        assert len(ids(out)) < count
        with out.open("a", encoding="utf-8") as f:
            f.write('{"id": "p1", "model": "x", "sequ')
        engine.release()
        assert main(args) == 0
        assert max(r.prompts for r in engine.requests if r.path == COMPLETIONS) == 16
    got = ids(out)
    assert sorted(got) == sorted(f"p{n}" for n in range(1, count + 1))
    assert all("error" not in r for r in records(out))


def test_cli_score_batches_lines(engine: FakeEngine, tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [5, 6 + i % 50, 7]}) + "\n" for i in range(64)))
    args = ["score", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp)]
    more = ["--quiet", "--prompts-per-request", "16", "--ordered", "--concurrency", "1"]
    assert main([*args, "--output", str(out), *more]) == 0
    assert [r["id"] for r in records(out)] == list(range(64))
    assert 1 < max(r.prompts for r in completions(engine)) <= 16


def test_cli_sweep_takes_prompts_per_request(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    ckpts = [write_adapter_archive(str(tmp_path / f"step-{n}.tar.gz"), engine.model, rank=4 * n) for n in (1, 2)]
    inp = write_prompts(tmp_path / "in.jsonl", 40)
    args = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", *ckpts]
    args += ["--input", str(inp), "--output-dir", str(tmp_path / "sweep"), "--quiet", "--prompts-per-request", "20"]
    assert main(args) == 0
    answered = [r for r in completions(engine) if r.status == 200]
    assert sum(r.prompts for r in answered) >= 80 and 1 < max(r.prompts for r in answered) <= 20


# -- FakeEngine -------------------------------------------------------------------------------------------------------


def test_fake_engine_request_overhead_is_paid_one_request_at_a_time(make_engine: Callable[..., FakeEngine]) -> None:
    """Four concurrent requests with a 0.1 s overhead each: their overheads do not overlap (one API server)."""
    engine = make_engine(request_overhead=0.1)
    with SamplerClient(engine.url, max_workers=4) as client:
        futures = [client.submit([5, i], base_model=engine.model) for i in range(4)]
        assert all(f.result(WAIT_SECONDS).model == engine.model for f in futures)
    # The lock is not FIFO: the last request to arrive may be served second, so the span is first start to last end.
    records = completions(engine)
    assert len(records) == 4
    assert max(r.finished for r in records) - min(r.started for r in records) >= 0.4 - 0.01
    with pytest.raises(ValueError, match="request_overhead"):
        FakeEngine(request_overhead=-1.0)


def test_fake_engine_answers_prompt_lists_as_vllm(engine: FakeEngine) -> None:
    """Choices indexed over the whole request, prompt by prompt; usage summed; one bad prompt refuses all."""
    import requests

    url = f"{engine.url}{COMPLETIONS}"
    body = {"model": engine.model, "prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 2, "return_token_ids": True}
    answer = requests.post(url, json=body, timeout=10).json()
    assert [(c["index"], c["prompt_token_ids"]) for c in answer["choices"]] == [
        (0, [5, 6]),
        (1, [5, 6]),
        (2, [7, 8, 9]),
        (3, [7, 8, 9]),
    ]
    assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 8
    refused = requests.post(url, json={**body, "prompt": [[5], [5] * 300]}, timeout=10)
    assert refused.status_code == 400 and "maximum context length" in refused.text
    for prompt, message in (([], "at least one prompt"), ([[5], []], "cannot be empty"), ([[5], "a"], "either")):
        refused = requests.post(url, json={**body, "prompt": prompt}, timeout=10)
        assert refused.status_code == 400 and message in refused.text
    texts = requests.post(url, json={**body, "prompt": ["ab", "c"]}, timeout=10).json()
    assert [c["prompt_token_ids"] for c in texts["choices"]] == [[101, 102], [101, 102], [103], [103]]
    assert completions(engine)[0].prompts == 2


# -- order and exactly-once, as a property -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[FakeEngine]:
    with FakeEngine(max_model_len=12) as engine:
        yield engine


def test_order_and_exactly_once_hold_for_any_mix(shared_engine: FakeEngine) -> None:
    """Random mixes of settings, bad prompts and batch sizes: each result in its slot, each bad prompt alone errs."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    prompt = st.lists(st.integers(min_value=4, max_value=1000), min_size=1, max_size=14)  # > 12 tokens: refused
    item = st.tuples(prompt, st.sampled_from([1, 2]), st.sampled_from([1, 3]), st.booleans())

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(
        items=st.lists(item, max_size=60),
        size=st.sampled_from([None, 1, 2, 5, 64]),
        workers=st.integers(1, 4),
        unordered=st.booleans(),
    )
    def check(items: List[Any], size: Optional[int], workers: int, unordered: bool) -> None:
        requests = [
            {
                "prompt": p,
                "base_model": shared_engine.model,
                "max_tokens": m,
                "num_samples": n,
                "seed": 1 if s else None,
            }
            for p, m, n, s in items
        ]
        limit = 12  # the engine's max_model_len: a prompt this long or longer is refused, else max_tokens clamped
        with SamplerClient(shared_engine.url, max_workers=workers) as client:
            if unordered:
                pairs = list(client.imap_unordered(requests, return_exceptions=True, prompts_per_request=size))
                assert sorted(i for i, _ in pairs) == list(range(len(items)))
                results = [r for _, r in sorted(pairs, key=lambda pair: pair[0])]
            else:
                results = client.sample_many(requests, return_exceptions=True, prompts_per_request=size)
        assert len(results) == len(items)
        for (p, m, n, _), result in zip(items, results):
            if len(p) >= limit:
                assert isinstance(result, BadRequestError)
                continue
            assert isinstance(result, SampleOutput), result
            assert len(result.sequences) == n and all(len(s.tokens) == min(m, limit - len(p)) for s in result.sequences)
            assert all(c["prompt_token_ids"] == p for c in result.body["choices"])

    check()
