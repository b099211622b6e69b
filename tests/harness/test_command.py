"""lm-eval's own command line with ``--model lora-sampler``: ``lora-sampler lm-eval`` and ``python -m
lora_sampler.lm_eval``, on task YAMLs over local files, against FakeEngine (a key-guarded one too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model, model_registry

from lora_sampler import EngineStatusError
from lora_sampler.cli import main
from lora_sampler.lm_eval import LoraSamplerLM
from lora_sampler.testing import FakeEngine


def results_of(output: Path) -> Dict[str, Any]:
    """The one results JSON lm-eval wrote under ``output``."""
    [found] = list(output.rglob("results_*.json"))
    result: Dict[str, Any] = json.loads(found.read_text(encoding="utf-8"))
    return result


def harness_args(engine: FakeEngine, tasks: Path, output: Path, model_args: str, *more: str) -> List[str]:
    model = f"base_url={engine.url},prefix_token_id=1" + (f",{model_args}" if model_args else "")
    where = ["--include_path", str(tasks), "--output_path", str(output)]
    return ["run", "--model", "lora-sampler", "--model_args", model, *where, *more]


@pytest.mark.timeout(900)  # lm-eval's task index alone takes a minute on a loaded 2-core machine
def test_lora_sampler_lm_eval_runs_all_three_output_types(
    engine: FakeEngine, tasks: Path, checkpoint: str, lora_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint published on first use; every metric of the three tasks; the model named in the results."""
    output = tmp_path / "out"
    model_args = f"adapter={checkpoint},lora_base_dir={lora_dir},num_concurrent=4,prompts_per_request=1"
    code = main(["lm-eval", *harness_args(engine, tasks, output, model_args, "--tasks", "tiny_mc,tiny_gen,tiny_ppl")])
    assert code == 0
    results = results_of(output)
    assert set(results["results"]) == {"tiny_mc", "tiny_gen", "tiny_ppl"}
    assert {"acc,none", "acc_norm,none"} <= set(results["results"]["tiny_mc"])
    assert "exact_match,none" in results["results"]["tiny_gen"]
    assert results["results"]["tiny_ppl"]["word_perplexity,none"] > 1.0
    config = results["config"]
    assert config["adapter"].startswith("step-1") and config["checkpoint"] == checkpoint
    assert config["base_model"] == engine.model
    assert engine.loaded_adapters  # the adapter served the requests


@pytest.mark.timeout(900)
def test_python_m_and_chat_template(engine: FakeEngine, tasks: Path, tmp_path: Path) -> None:
    """``python -m lora_sampler.lm_eval`` is the same command line; --apply_chat_template renders via the engine."""
    output = tmp_path / "out"
    args = harness_args(engine, tasks, output, "", "--tasks", "tiny_gen", "--apply_chat_template", "--log_samples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "lora_sampler.lm_eval", *args], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    [samples] = list(output.rglob("samples_tiny_gen_*.jsonl"))
    first = json.loads(samples.read_text(encoding="utf-8").splitlines()[0])
    assert first["arguments"]["gen_args_0"]["arg_0"].startswith("<|user|>\nQ: ")


@pytest.mark.timeout(900)
def test_an_engine_that_requires_a_key(tasks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key comes from $LORA_SAMPLER_API_KEY, reaches the engine and appears in no results file."""
    key = "sk-test-7f3e9a"
    with FakeEngine(api_key=key, max_model_len=64) as engine:
        output = tmp_path / "out"
        monkeypatch.delenv("LORA_SAMPLER_API_KEY", raising=False)
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        with pytest.raises(EngineStatusError) as refused:
            LoraSamplerLM(base_url=engine.url, prefix_token_id=1).loglikelihood(
                [Instance(request_type="loglikelihood", doc={}, arguments=("a", "b"), idx=0)]
            )
        assert refused.value.status == 401
        engine.reset_log()
        monkeypatch.setenv("LORA_SAMPLER_API_KEY", key)
        assert main(["lm-eval", *harness_args(engine, tasks, output, "", "--tasks", "tiny_mc")]) == 0
        assert all(record.has_auth for record in engine.requests if record.path.startswith("/v1"))
    assert results_of(output)["results"]["tiny_mc"]["acc,none"] >= 0
    assert not [path for path in output.rglob("*") if path.is_file() and key in path.read_text(errors="replace")]


def test_a_key_in_model_args_is_refused(engine: FakeEngine, tasks: Path, tmp_path: Path, capsys: Any) -> None:
    """api_key=... in --model_args fails before any request, pointing to the environment variable (the command
    line's one error path prints the message and exits 2)."""
    output = tmp_path / "out"
    engine.reset_log()
    code = main(["lm-eval", *harness_args(engine, tasks, output, "api_key=sk-nope", "--tasks", "tiny_mc")])
    error = capsys.readouterr().err
    assert code == 2 and "lora-sampler: error: api_key in model_args" in error and "LORA_SAMPLER_API_KEY" in error
    assert "sk-nope" not in error and not output.exists() and not engine.requests


def test_lm_evals_own_models_stay_resolvable() -> None:
    """Registering lora-sampler keeps lm-eval's models: local-completions resolves, hf and vllm are known."""
    assert get_model("lora-sampler") is LoraSamplerLM
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"
    assert {"hf", "vllm", "local-chat-completions"} <= set(model_registry.keys())


def test_the_cli_imports_lm_eval_only_for_its_command() -> None:
    """Every other lora-sampler command runs without importing lm-eval (it is an optional extra)."""
    code = (
        "import sys; from lora_sampler.cli import main; import lora_sampler; "
        "main(['sample', '--help']) if False else None; "
        "from lora_sampler.cli import build_parser; build_parser().format_help(); "
        "assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()


def test_help_lists_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "lora_sampler", "--help"], capture_output=True, timeout=120)
    assert b"lm-eval" in done.stdout
