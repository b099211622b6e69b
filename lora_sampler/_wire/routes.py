"""The HTTP routes and headers of vLLM's OpenAI-compatible server and of vllm-router, each written once.

Pure names: no I/O. The client, the batch formats and FakeEngine all speak these.
"""

from __future__ import annotations

#: Text completions; token-id prompts go here too.
COMPLETIONS_PATH = "/v1/completions"
#: Chat completions: ``messages`` rendered by the engine's chat template.
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
#: Runtime LoRA load (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); body ``{"lora_name", "lora_path"}``.
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
#: Runtime LoRA unload; body ``{"lora_name"}``.
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
#: The served models: the base model card and one card per loaded adapter.
MODELS_PATH = "/v1/models"
#: vLLM's tokenizer route: ``{"model", "prompt"}`` gives ``{"tokens": [...]}``.
TOKENIZE_PATH = "/tokenize"
#: vLLM's detokenizer route: ``{"model", "tokens"}`` gives ``{"prompt": text}``.
DETOKENIZE_PATH = "/detokenize"
#: vLLM's liveness route: 200 with an empty body while the engine serves.
HEALTH_PATH = "/health"
#: vLLM's second liveness route (SageMaker's name for it); answers as ``/health`` does.
PING_PATH = "/ping"
#: The prefix of the OpenAI-compatible routes, the ones an API key guards (``/health`` stays open).
API_PREFIX = "/v1"
#: vllm-router's list of its workers.
LIST_WORKERS_PATH = "/list_workers"
#: Header vLLM routers hash to pick a replica.
SESSION_HEADER = "X-Session-ID"
#: Header carrying a fresh id per attempt, so one attempt can be found in the engine's and a proxy's logs.
REQUEST_ID_HEADER = "X-Request-Id"

#: The completion routes (text and chat): the ones that sample, and whose ``model`` may be an adapter.
COMPLETION_PATHS = (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH)
#: The runtime adapter routes, registered only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
ADAPTER_COMMAND_PATHS = (LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH)
#: Every endpoint the client calls: a base URL must not end in one (the client appends them to the engine root).
ENDPOINT_PATHS = (*COMPLETION_PATHS, MODELS_PATH, *ADAPTER_COMMAND_PATHS, TOKENIZE_PATH, DETOKENIZE_PATH, HEALTH_PATH)
