"""Pin the real engine's HTTP behaviour with plain ``requests``, body for body.

These are the facts the client's retry table and the fake engine are built on; if a vLLM upgrade changes
one of them, this file says which. Each scenario uses a fresh adapter name, because the engine never
forgets a name it has resolved. Adapter directories are never deleted while the engine runs:
deleting an adapter the engine may reload from disk kills it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import requests

if TYPE_CHECKING:
    from conftest import RealEngine


def sanitize(message: str) -> str:
    """Return ``message`` as vLLM 0.32 sends it: file paths replaced by ``<path>``.

    vLLM's ``sanitize_message`` (``entrypoints/serve/exception_handling/utils.py``) runs on every error message:
    an absolute path under /home, /usr, /opt, /var, /tmp, /root, /lib, /mnt or /srv, and any path ending in a
    file name with an extension, becomes ``<path>`` (a sentence-ending ``.`` right after the path is eaten by
    the match). So with the model under ``~/.cache`` the 404 reads ``Valid aliases: <path>``.
    """
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def _error(message: str, type_: str, code: int, param: str | None = None) -> dict[str, object]:
    """Return vLLM's error body ``{"error": {...}}`` (the message sanitized as the engine does)."""
    return {"error": {"message": sanitize(message), "type": type_, "param": param, "code": code}}


def _not_found(engine: RealEngine, name: str) -> dict[str, object]:
    """Return the generic 404 body for a model name the engine does not know."""
    return _error(f"The model `{name}` does not exist. Valid aliases: {engine.model}.", "NotFoundError", 404, "model")


def _not_loadable(name: str) -> dict[str, object]:
    """Return the 400 body for an adapter directory that is present but cannot be loaded."""
    return _error(f"LoRA adapter '{name}' was found but could not be loaded.", "BadRequestError", 400)


def _assert_completion(response: requests.Response, model: str) -> None:
    """Assert a successful completion for ``model`` with 4 tokens and logprobs."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["model"] == model
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 4
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert len(choice["logprobs"]["token_logprobs"]) == 4
    assert choice["finish_reason"] == "length"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write one file with a temporary name and ``os.replace`` (the reader sees all of it or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_models_lists_the_base_model(vllm_engine: RealEngine) -> None:
    response = requests.get(f"{vllm_engine.url}/v1/models", headers=vllm_engine.headers(), timeout=10)
    assert response.status_code == 200
    cards = {card["id"]: card for card in response.json()["data"]}
    base = cards[vllm_engine.model]
    assert base["root"] == vllm_engine.model
    assert base["parent"] is None
    assert base["max_model_len"] == 256


def test_unknown_model_is_a_generic_404(vllm_engine: RealEngine, adapter_name: str) -> None:
    response = vllm_engine.complete(adapter_name)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json() == _not_found(vllm_engine, adapter_name)
    if re.match(r"/(home|usr|opt|var|tmp|root|lib|mnt|srv)/", vllm_engine.model):
        assert response.json()["error"]["message"].endswith("does not exist. Valid aliases: <path>")

    (vllm_engine.lora_dir / adapter_name).mkdir()  # an empty directory is still "does not exist"
    assert vllm_engine.complete(adapter_name).json() == _not_found(vllm_engine, adapter_name)


def test_atomic_publish_serves_the_first_request(vllm_engine: RealEngine, adapter_name: str) -> None:
    vllm_engine.publish(adapter_name)
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)
    assert f"Resolved and loaded LoRA adapter '{adapter_name}'" in vllm_engine.log_text()
    models = requests.get(f"{vllm_engine.url}/v1/models", headers=vllm_engine.headers(), timeout=10).json()
    card = {card["id"]: card for card in models["data"]}[adapter_name]
    assert (card["root"], card["parent"]) == (str(vllm_engine.lora_dir / adapter_name), vllm_engine.model)


def test_archive_extracted_adapter_serves(vllm_engine: RealEngine, adapter_name: str, tmp_path: Path) -> None:
    extracted = tmp_path / "extracted"
    shutil.unpack_archive(vllm_engine.adapter_archive, extracted, format="gztar")
    assert sorted(p.name for p in extracted.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    vllm_engine.publish(adapter_name, extracted)
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)


def test_adapter_changes_the_output(vllm_engine: RealEngine, adapter_name: str) -> None:
    vllm_engine.publish(adapter_name)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    base = vllm_engine.complete(vllm_engine.model, **greedy).json()["choices"][0]["token_ids"]
    lora = vllm_engine.complete(adapter_name, **greedy).json()["choices"][0]["token_ids"]
    assert base != lora


def test_non_atomic_publish_is_400_until_the_weights_land(vllm_engine: RealEngine, adapter_name: str) -> None:
    target = vllm_engine.lora_dir / adapter_name
    target.mkdir()
    shutil.copy2(vllm_engine.adapter_dir / "adapter_config.json", target / "adapter_config.json")
    for _ in range(2):  # not cached: every request retries the load and fails the same way
        response = vllm_engine.complete(adapter_name)
        assert response.status_code == 400
        assert response.json() == _not_loadable(adapter_name)

    weights = (vllm_engine.adapter_dir / "adapter_model.safetensors").read_bytes()
    _write_atomically(target / "adapter_model.safetensors", weights)
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)


def test_zero_byte_config_is_a_json_decode_400(vllm_engine: RealEngine, adapter_name: str) -> None:
    target = vllm_engine.lora_dir / adapter_name
    target.mkdir()
    shutil.copy2(vllm_engine.adapter_dir / "adapter_model.safetensors", target / "adapter_model.safetensors")
    (target / "adapter_config.json").write_bytes(b"")
    response = vllm_engine.complete(adapter_name)
    assert response.status_code == 400
    assert response.json() == _error("Expecting value: line 1 column 1 (char 0)", "BadRequestError", 400)

    half = (vllm_engine.adapter_dir / "adapter_config.json").read_bytes()
    _write_atomically(target / "adapter_config.json", half[: len(half) // 2])
    response = vllm_engine.complete(adapter_name)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith(("Unterminated string", "Expecting")), message

    _write_atomically(target / "adapter_config.json", half)  # now complete: no poisoning
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)


def test_rank_above_max_lora_rank_is_not_loadable(vllm_engine: RealEngine, adapter_name: str, tmp_path: Path) -> None:
    source = tmp_path / "r16"
    shutil.copytree(vllm_engine.adapter_dir, source)
    config = json.loads((source / "adapter_config.json").read_text())
    config["r"] = 16
    (source / "adapter_config.json").write_text(json.dumps(config))
    vllm_engine.publish(adapter_name, source)
    response = vllm_engine.complete(adapter_name)
    assert response.status_code == 400
    assert response.json() == _not_loadable(adapter_name)


def test_wrong_base_model_is_a_404(vllm_engine: RealEngine, adapter_name: str, tmp_path: Path) -> None:
    source = tmp_path / "other-base"
    shutil.copytree(vllm_engine.adapter_dir, source)
    config = json.loads((source / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = vllm_engine.model + "-other"
    (source / "adapter_config.json").write_text(json.dumps(config))
    vllm_engine.publish(adapter_name, source)
    assert vllm_engine.complete(adapter_name).json() == _not_found(vllm_engine, adapter_name)


def test_load_endpoint_bodies(vllm_engine: RealEngine, adapter_name: str) -> None:
    path = vllm_engine.adapter_dirs[1]
    response = vllm_engine.load_adapter(adapter_name, path)
    assert response.status_code == 200
    assert response.text == f"Success: LoRA adapter '{adapter_name}' added successfully."
    assert "content-type" not in {key.lower() for key in response.headers}

    response = vllm_engine.load_adapter(adapter_name, path)
    assert response.status_code == 400
    assert response.json() == _error(
        f"The lora adapter '{adapter_name}' has already been loaded. "
        "If you want to load the adapter in place, set 'load_inplace' to True.",
        "InvalidUserInput",
        400,
    )
    assert vllm_engine.load_adapter(adapter_name, path, load_inplace=True).status_code == 200
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)

    response = vllm_engine.unload_adapter(adapter_name)
    assert response.status_code == 200
    assert response.text == f"Success: LoRA adapter '{adapter_name}' removed successfully."
    assert vllm_engine.complete(adapter_name).json() == _not_found(vllm_engine, adapter_name)


def test_load_of_a_resolver_loaded_name_is_already_loaded(vllm_engine: RealEngine, adapter_name: str) -> None:
    published = vllm_engine.publish(adapter_name)
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)
    response = vllm_engine.load_adapter(adapter_name, published)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(f"The lora adapter '{adapter_name}' has already been loaded.")

    assert vllm_engine.unload_adapter(adapter_name).status_code == 200  # directory still there: re-resolves
    _assert_completion(vllm_engine.complete(adapter_name), adapter_name)


def test_load_of_a_missing_path_is_404(vllm_engine: RealEngine, adapter_name: str) -> None:
    missing = vllm_engine.lora_dir.parent / "does-not-exist"
    response = vllm_engine.load_adapter(adapter_name, missing)
    assert response.status_code == 404
    assert response.json() == _error(
        f"Loading lora {adapter_name} failed: No adapter found for {missing}", "NotFoundError", 404
    )


def test_unload_of_an_unknown_name_is_404(vllm_engine: RealEngine, adapter_name: str) -> None:
    response = vllm_engine.unload_adapter(adapter_name)
    assert response.status_code == 404
    assert response.json() == _error(f"The lora adapter '{adapter_name}' cannot be found.", "NotFoundError", 404)


def test_wrong_or_missing_api_key_is_401(vllm_engine: RealEngine) -> None:
    cases = {
        "wrong key": vllm_engine.headers("wrong-key"),
        "no key": {},
        "no Bearer": {"Authorization": vllm_engine.api_key},
        "x-api-key": {"x-api-key": vllm_engine.api_key},
    }
    for case, headers in cases.items():
        response = vllm_engine.complete("ghost-for-auth", headers=headers)  # auth is checked before the model
        assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"}), case
    response = requests.get(f"{vllm_engine.url}/v1/models", timeout=10)
    assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
    response = requests.get(f"{vllm_engine.url}/health", timeout=10)
    assert (response.status_code, response.content) == (200, b"")


def test_over_length_prompt_is_400(vllm_engine: RealEngine, adapter_name: str) -> None:
    expected = _error(
        "This model's maximum context length is 256 tokens. However, your prompt contains 300 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=300)",
        "BadRequestError",
        400,
        "input_tokens",
    )
    vllm_engine.publish(adapter_name)
    for model in (vllm_engine.model, adapter_name):  # the adapter is loaded first, then the request rejected
        response = vllm_engine.complete(model, [5] * 300)
        assert response.status_code == 400
        assert response.json() == expected

    response = vllm_engine.complete(vllm_engine.model, max_tokens=1000)
    assert response.status_code == 400
    assert response.json() == _error(
        "max_tokens=1000 cannot be greater than max_model_len=256. Please request fewer output tokens. "
        "(parameter=max_tokens, value=1000)",
        "BadRequestError",
        400,
        "max_tokens",
    )

    response = vllm_engine.complete(vllm_engine.model, [5] * 250, max_tokens=10, ignore_eos=True)
    assert response.status_code == 200
    assert response.json()["usage"]["total_tokens"] == 256  # silently clamped to 6 completion tokens


def test_unknown_model_with_over_length_prompt_is_the_404(vllm_engine: RealEngine, adapter_name: str) -> None:
    assert vllm_engine.complete(adapter_name, [5] * 300).json() == _not_found(vllm_engine, adapter_name)


def test_runtime_updating_off(vllm_engine_static: RealEngine) -> None:
    engine = vllm_engine_static
    name = engine.fresh_name("static")
    response = engine.load_adapter(name, engine.adapter_dir)
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    response = engine.unload_adapter(name)
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    engine.publish(name)  # the resolver is never consulted without runtime updating
    response = engine.complete(name)
    assert (response.status_code, response.json()) == (404, _not_found(engine, name))


def test_shared_body_table_matches_the_engine(vllm_engine: RealEngine, adapter_name: str) -> None:
    """``lora_sampler.testing._bodies`` (what the fake engine sends) against the real answers.

    The table keeps file paths in messages; the real engine replaces them with ``<path>`` (see ``sanitize``),
    so the table's messages are sanitized before the comparison.
    """
    from lora_sampler.testing import _bodies

    def same(response: requests.Response, expected: _bodies.VllmBody) -> None:
        assert response.status_code == expected.status
        if expected.content_type is None:
            assert (response.text, response.headers.get("content-type")) == (expected.text, None)
            return
        assert response.headers["content-type"] == expected.content_type
        body = expected.json()
        if isinstance(body.get("error"), dict):
            body["error"]["message"] = sanitize(body["error"]["message"])
        assert response.json() == body

    engine = vllm_engine
    same(engine.complete(adapter_name), _bodies.model_not_found(adapter_name, engine.model))
    same(engine.complete(adapter_name, headers={}), _bodies.unauthorized())
    same(engine.complete(engine.model, [5] * 300), _bodies.prompt_too_long(256, 300))
    same(engine.complete(engine.model, max_tokens=1000), _bodies.max_tokens_too_large(1000, 256))
    same(engine.unload_adapter(adapter_name), _bodies.unload_not_found(adapter_name))
    missing = engine.lora_dir.parent / "no-adapter-here"
    same(engine.load_adapter(adapter_name, missing), _bodies.load_no_adapter(adapter_name, str(missing)))

    target = engine.lora_dir / adapter_name
    target.mkdir()
    (target / "adapter_config.json").write_bytes(b"")
    same(engine.complete(adapter_name), _bodies.adapter_config_json_error(""))
    _write_atomically(target / "adapter_config.json", (engine.adapter_dir / "adapter_config.json").read_bytes())
    same(engine.complete(adapter_name), _bodies.adapter_not_loadable(adapter_name))
    _write_atomically(
        target / "adapter_model.safetensors", (engine.adapter_dir / "adapter_model.safetensors").read_bytes()
    )
    assert engine.complete(adapter_name).status_code == 200
    same(engine.load_adapter(adapter_name, target), _bodies.already_loaded(adapter_name))
    same(engine.unload_adapter(adapter_name), _bodies.unload_success(adapter_name))
    same(engine.load_adapter(adapter_name, target), _bodies.load_success(adapter_name))
