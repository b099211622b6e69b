"""Plain public-API usage, type-checked by ``tox -e type`` (never run): the API's types must hold for users."""

from __future__ import annotations

import concurrent.futures
from typing import List

import requests

import lora_sampler
from lora_sampler import (
    Adapter,
    GeneratedSequence,
    OutageEvent,
    RetryEvent,
    RetryPolicy,
    SampleOutput,
    SamplerClient,
    SampleRequest,
    SamplingParams,
    ScoreOutput,
    ScoreRequest,
    sweep,
)


def on_retry(event: RetryEvent) -> None:
    print(event.attempt, event.max_attempts, event.wait, event.model, event.adapter)


def on_outage(event: OutageEvent) -> None:
    print(event.kind, event.waited, event.max_outage, event.held)


def use_the_api() -> None:
    policy = RetryPolicy(max_attempts=3, on_retry=on_retry)
    with SamplerClient("http://127.0.0.1:8000/v1", api_key="k", lora_base_dir="/loras", retry=policy) as client:
        adapter: Adapter = client.publish("runs/step-400.tar.gz", lineage="run-17")
        output: SampleOutput = client.sample([1, 2, 3], adapter=adapter, sampling_params=SamplingParams(seed=1))
        first: GeneratedSequence = output.sequences[0]
        tokens: tuple[int, ...] = first.tokens
        print(tokens, first.logprobs, first.stop_reason, first.text)
        served: tuple[str, ...] = client.served_base_models()
        future: concurrent.futures.Future[SampleOutput] = client.submit("hello", base_model=served[0])
        print(future.result().sequences)
        many: List[object] = client.sample_many([SampleRequest([1], adapter="step-400")], return_exceptions=True)
        print(many)
        chat: SampleOutput = client.chat([{"role": "user", "content": "hi"}], base_model=served[0])
        print(chat.sequences, client.replicas())
        client.wait_ready(30.0)
        for index, result in client.imap_unordered(
            [{"prompt": [1], "base_model": "m"}], max_outage=60.0, on_outage=on_outage
        ):
            print(index, result)
        logprobs: tuple[float | None, ...] = client.compute_logprobs("some text", adapter=adapter)
        scores: List[ScoreOutput] = client.sample_many([ScoreRequest([1, 2], completion="x", base_model=served[0])])
        total: float = scores[0].total
        top = client.sample([1, 2], base_model=served[0], topk_prompt_logprobs=5).topk_prompt_logprobs
        print(logprobs, total, scores[0].scored_tokens, top[1] if top is not None else None)
        client.unload(adapter, delete_files=True)
    stored = SamplerClient("http://h", lora_base_dir="/loras", storage_options={"endpoint_url": "http://minio:9000"})
    print(stored.publish("s3://ckpts/run1/step-400.tar.gz").source)
    try:
        SamplerClient("http://h").sample([1], base_model="m")
    except requests.HTTPError as error:  # engine status errors are requests.HTTPError
        print(error.response)
    except lora_sampler.LoraSamplerError as error:
        print(error.attempts)


def sweep_a_run(client: SamplerClient) -> float:
    """A sweep from Python: reports are typed, as are their ledger lines."""
    from lora_sampler.batch import CheckpointReport, Manifest

    best = float("-inf")
    for report in sweep(client, Manifest("run/checkpoints.jsonl"), "prompts.jsonl", output_dir="evals", window=2):
        checked: CheckpointReport = report
        if checked.ok and checked.mean_logprob is not None:
            best = max(best, checked.mean_logprob)
        print(checked.step, checked.rows, checked.ledger_line()["checkpoint"])
    for report in sweep(client, ["run/step-*.tar.gz"], [{"prompt": [1, 2]}], output_dir="evals2", watch=True):
        print(report.error)
    scored = sweep(client, "run/*.tar.gz", "heldout.jsonl", output_dir="evals3", score=True, progress=True)
    sums = [(r.step, r.mean_sum) for r in scored if r.mean_sum is not None and not r.resumed]
    sampled = sweep(client, "run/*.tar.gz", "p.jsonl", output_dir="e4", max_tokens=8, temperature=0.0, stop=["\n"])
    print(sums, [r.tokens for r in sampled])
    return best
