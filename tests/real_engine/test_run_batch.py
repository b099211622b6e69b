"""One OpenAI batch file of chat lines through vLLM's own run-batch and through ``lora-sampler sample``.

The check that lora_sampler's batch format and sampling mean what vLLM means: the same file (greedy, a LoRA
adapter and the base model) read by ``python -m vllm.entrypoints.openai.run_batch`` (offline, the adapter given
by ``--lora-modules``) and by ``lora-sampler sample`` against the served engine (the adapter published into the
resolver folder under the same name) gives the same custom ids, status codes, finish reasons, prompt token ids and
generated token ids. It also shows that vLLM renders the tiny model's chat template exactly as FakeEngine does.

run-batch loads the model once more (about 30 s); it runs before the shared engine starts (``conftest`` orders
this module right after the static-engine tests), so two engines never hold memory at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from lora_sampler.cli import main
from lora_sampler.testing import render_chat

#: Read by ``conftest.pytest_collection_modifyitems``: run before the shared engine starts.
RUNS_BEFORE_SHARED_ENGINE = True
#: Seconds run-batch may take (a model load and six short requests; about 30 s).
RUN_BATCH_TIMEOUT = 600.0
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Name one layer of the model."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is a checkpoint?"}],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": "Go on."},
    ],
]


def _batch_lines(adapter: str, base_model: str) -> list[dict[str, Any]]:
    """Chat lines for each conversation, once for the adapter and once for the base model (greedy)."""
    lines = []
    for kind, model in (("lora", adapter), ("base", base_model)):
        for number, messages in enumerate(CONVERSATIONS):
            body = {
                "model": model,
                "messages": messages,
                "temperature": 0,
                "max_tokens": 8,
                "logprobs": True,
                "return_token_ids": True,
                "return_prompt_text": True,
            }
            lines.append(
                {"custom_id": f"{kind}-{number}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    return lines


def _run_vllm_batch(
    env: Any, settings: Any, workdir: Path, inp: Path, out: Path, adapter: str, adapter_dir: Path
) -> None:
    """Run vLLM's run-batch with the served engine's settings in its own process group; the group is always gone
    afterwards."""
    environ = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONHOME")}
    environ.update(settings.environ())
    environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    command = [str(env.python), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(out)]
    command += ["--model", str(env.model_dir), *settings.server_flags(), "--lora-modules", f"{adapter}={adapter_dir}"]
    log_path = workdir / "run-batch.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=environ,
            start_new_session=True,
        )
    try:
        code = process.wait(timeout=RUN_BATCH_TIMEOUT)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # leftovers of the group (engine core, workers)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        process.wait()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
    assert code == 0 and out.exists(), f"run-batch exited with {code}; tail of {log_path}:\n{tail}"


def _by_custom_id(path: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    return {record["custom_id"]: record for record in records}


def test_run_batch_and_lora_sampler_give_the_same_answers(
    vllm_env: Any, engine_settings: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Same custom ids, status codes, finish reasons, prompt and generated token ids from both runners."""
    adapter = f"batch-lora-{uuid.uuid4().hex[:6]}"
    adapter_dir = vllm_env.adapter_dirs[0]
    inp = tmp_path / "in.jsonl"
    lines = _batch_lines(adapter, str(vllm_env.model_dir))
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines), "utf-8")
    theirs_path, ours_path = tmp_path / "run-batch.jsonl", tmp_path / "lora-sampler.jsonl"
    _run_vllm_batch(vllm_env, engine_settings, tmp_path, inp, theirs_path, adapter, adapter_dir)

    engine = request.getfixturevalue("vllm_engine")  # started only now: run-batch has exited
    engine.publish(adapter, adapter_dir)
    argv = ["sample", "--base-url", engine.url, "--api-key", engine.api_key, "--lora-base-dir", str(engine.lora_dir)]
    assert main([*argv, "--input", str(inp), "--output", str(ours_path), "--quiet"]) == 0  # format auto-detected

    theirs, ours = _by_custom_id(theirs_path), _by_custom_id(ours_path)
    assert set(theirs) == set(ours) == {line["custom_id"] for line in lines}
    for line in lines:
        custom_id, messages = line["custom_id"], line["body"]["messages"]
        mine, vllms = ours[custom_id], theirs[custom_id]
        assert mine["error"] is None and vllms["error"] is None, (mine["error"], vllms["error"])
        assert mine["response"]["status_code"] == vllms["response"]["status_code"] == 200
        body, expected = mine["response"]["body"], vllms["response"]["body"]
        assert body["model"] == expected["model"] == line["body"]["model"]
        assert [c["finish_reason"] for c in body["choices"]] == [c["finish_reason"] for c in expected["choices"]]
        assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for c in expected["choices"]], custom_id
        assert body["prompt_token_ids"] == expected["prompt_token_ids"]
        assert expected["prompt_text"] == render_chat(messages)  # vLLM renders FakeEngine's template
    generated = {cid: ours[cid]["response"]["body"]["choices"][0]["token_ids"] for cid in ours}
    assert any(generated[f"lora-{n}"] != generated[f"base-{n}"] for n in range(len(CONVERSATIONS)))  # LoRA applied


def test_chat_answers_match_the_fake(vllm_env: Any, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The real chat answer has FakeEngine's fields; an unknown adapter gets the completions 404 on chat too;
    client.chat resolves a freshly published adapter and returns its token ids and logprobs."""
    from lora_sampler import SamplerClient, SamplingParams
    from lora_sampler.testing import FakeEngine

    engine = request.getfixturevalue("vllm_engine")
    messages = CONVERSATIONS[1]
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    chat_404 = engine.session.post(
        f"{engine.url}/v1/chat/completions", json={"model": ghost, "messages": messages}, headers=engine.headers()
    )
    completion_404 = engine.complete(ghost)
    assert chat_404.status_code == completion_404.status_code == 404 and chat_404.json() == completion_404.json()
    adapter = f"chat-lora-{uuid.uuid4().hex[:6]}"
    engine.publish(adapter)
    params = SamplingParams(max_tokens=5, seed=0)  # n > 1 needs a temperature above 0 (greedy gives one sample)
    with SamplerClient(engine.url, api_key=engine.api_key, lora_base_dir=engine.lora_dir) as client:
        real = client.chat(messages, adapter=adapter, sampling_params=params, num_samples=2)
    assert real.model == adapter and [len(s.tokens) for s in real.sequences] == [5, 5]
    assert all(len(s.logprobs) == 5 and all(lp <= 0 for lp in s.logprobs) for s in real.sequences)
    with FakeEngine() as fake, SamplerClient(fake.url) as client:
        faked = client.chat(messages, base_model=fake.model, sampling_params=params)
    assert real.body is not None and faked.body is not None
    assert set(real.body) == set(faked.body)
    assert set(real.body["choices"][0]) == set(faked.body["choices"][0])
    assert set(real.body["choices"][0]["message"]) == set(faked.body["choices"][0]["message"])
    assert set(real.body["choices"][0]["logprobs"]["content"][0]) == set(
        faked.body["choices"][0]["logprobs"]["content"][0]
    )
