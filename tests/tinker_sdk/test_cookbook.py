"""tinker-cookbook 0.6.1's own code, unchanged, against FakeEngine through ``lora_sampler.tinker``.

Its completers, ``SamplerNLLEvaluator``, a group rollout, ``run_benchmark`` on a local dataset folder and
``BenchmarkEvaluator`` in a sweep: the code Tinker users already have. On a1a82fa none of it could run (no
``lora_sampler.tinker``). Needs the cookbook and the CPU torch (``tox -e tinker``); nothing reaches the Hub.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest

from lora_sampler import SamplerClient, sweep
from lora_sampler.testing import ByteTokenizer, FakeEngine

PROMPT = [10, 11, 12, 13]


@pytest.fixture
def renderer(cookbook: Any) -> Any:
    """tinker-cookbook's ``role_colon`` renderer over FakeEngine's tokenizer."""
    from tinker_cookbook.renderers import get_renderer

    return get_renderer("role_colon", ByteTokenizer())


@pytest.fixture
def sampling_client(service: Any) -> Any:
    return service.create_sampling_client(base_model="tiny-base").result()


def test_token_completer(tinker: Any, cookbook: Any, sampling_client: Any) -> None:
    from tinker_cookbook.completers import TinkerTokenCompleter

    completer = TinkerTokenCompleter(sampling_client, max_tokens=6, temperature=0.0)  # greedy: repeatable
    result = asyncio.run(completer(tinker.ModelInput.from_ints(PROMPT), stop=[]))
    assert len(result.tokens) == 6 and len(result.logprobs) == 6 and result.stop_reason == "length"
    assert result.sequence_id and result.prompt_cache_hit_tokens == 0
    capped = asyncio.run(completer(tinker.ModelInput.from_ints(PROMPT), stop=[result.tokens[1]], max_tokens=4))
    assert capped.stop_reason == "stop" and capped.tokens == result.tokens[:2]


def test_message_completer_with_the_role_colon_renderer(cookbook: Any, renderer: Any, sampling_client: Any) -> None:
    from tinker_cookbook.completers import TinkerMessageCompleter

    completer = TinkerMessageCompleter(sampling_client, renderer, max_tokens=12)
    message = asyncio.run(completer([{"role": "user", "content": "What is 2+2?"}]))
    assert message["role"] == "assistant" and isinstance(message["content"], str)


def test_sampler_nll_evaluator_matches_the_logprobs(tinker: Any, cookbook: Any, sampling_client: Any) -> None:
    import numpy as np
    from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator

    sequences = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]]
    data = []
    for tokens in sequences:
        targets = np.array(tokens[1:], dtype=np.int64)
        weights = np.ones(len(targets), dtype=np.float32)
        weights[0] = 0.0  # the first target is context, not scored
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(targets),
                    "weights": tinker.TensorData.from_numpy(weights),
                },
            )
        )
    metrics = asyncio.run(SamplerNLLEvaluator(data, name="heldout")(sampling_client))
    total, count = 0.0, 0
    for tokens in sequences:
        logprobs = sampling_client.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
        total -= sum(logprobs[2:])
        count += len(tokens) - 2
    assert metrics["heldout/nll"] == pytest.approx(total / count, rel=1e-5)


class _GuessEnv:
    """One RL episode: the reward is 1 when the completion's first token is even."""

    def __init__(self, index: int) -> None:
        self.index = index

    async def initial_observation(self) -> Any:
        import tinker

        return tinker.ModelInput.from_ints([10 + self.index, 11, 12]), []

    async def step(self, action: List[int], *, extra: Any = None) -> Any:
        import tinker
        from tinker_cookbook.rl.types import StepResult

        return StepResult(
            reward=float(action[0] % 2 == 0),
            episode_done=True,
            next_observation=tinker.ModelInput.from_ints([]),
            next_stop_condition=[],
            metrics={"first": float(action[0])},
        )


def _group_builder(size: int) -> Any:
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder

    class GuessEnv(_GuessEnv, Env):
        pass

    class Builder(EnvGroupBuilder):
        async def make_envs(self) -> Sequence[Any]:
            return [GuessEnv(i) for i in range(size)]

    return Builder()


def test_a_group_rollout(cookbook: Any, sampling_client: Any) -> None:
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.rollouts import do_group_rollout

    group = asyncio.run(do_group_rollout(_group_builder(4), TinkerTokenCompleter(sampling_client, max_tokens=3)))
    rewards = group.get_total_rewards()
    assert len(group.trajectories_G) == 4 and len(rewards) == 4
    for trajectory, reward in zip(group.trajectories_G, rewards):
        action = trajectory.transitions[0].ac.tokens
        assert len(action) == 3 and reward == float(action[0] % 2 == 0)


def _gsm8k_folder(root: Path, rows: List[Dict[str, str]]) -> None:
    """A local copy of openai/gsm8k's ``main`` config, where ``load_dataset("openai/gsm8k", name="main")`` finds it."""
    folder = root / "openai" / "gsm8k"
    (folder / "main").mkdir(parents=True)
    (folder / "main" / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n    path: main/test.jsonl\n---\n"
    )


GSM8K_ROWS = [
    {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "What is 3+5?", "answer": "3+5=8\n#### 8"},
    {"question": "What is 10-7?", "answer": "10-7=3\n#### 3"},
]


def test_run_benchmark_on_a_local_dataset_folder(
    cookbook: Any, renderer: Any, sampling_client: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    from tinker_cookbook.eval.benchmarks import BenchmarkConfig, run_benchmark

    _gsm8k_folder(tmp_path, GSM8K_ROWS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    config = BenchmarkConfig(max_examples=3, max_tokens=16, save_dir=str(tmp_path / "evals"), num_samples=2)
    result = asyncio.run(run_benchmark("gsm8k", sampling_client, renderer, config))
    assert result.num_examples == 3 * 2 and result.num_errors == 0  # each example sampled twice (pass@k)
    assert 0.0 <= result.score <= 1.0 and not math.isnan(result.score)
    assert set(result.pass_at_k) and all(0.0 <= v <= 1.0 for v in result.pass_at_k.values())


def test_benchmark_evaluator_in_a_sweep(
    cookbook: Any,
    renderer: Any,
    engine: FakeEngine,
    lora_dir: Path,
    checkpoints: List[Path],
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    from tinker_cookbook.eval.benchmark_evaluator import BenchmarkEvaluator

    from lora_sampler.tinker import TinkerEvaluator

    _gsm8k_folder(tmp_path, GSM8K_ROWS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    evaluator = BenchmarkEvaluator("gsm8k", renderer, max_examples=2, max_tokens=8)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        reports = list(
            sweep(
                client,
                [str(p) for p in checkpoints[:2]],
                evaluator=TinkerEvaluator(evaluator),
                output_dir=tmp_path / "o",
            )
        )
    assert [r.step for r in reports] == [100, 200]
    for report in reports:
        assert report.ok and report.metrics["eval/gsm8k/num_examples"] == 2.0
        assert 0.0 <= report.metrics["eval/gsm8k/score"] <= 1.0
