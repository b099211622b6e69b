"""Test helpers for code that uses lora_sampler: ``FakeEngine``, a loopback stand-in for vLLM.

Stdlib only: importing it loads neither requests, backoff nor the client, and never pytest (the ``lora_engine``
fixture is a separate pytest plugin module).
"""

from __future__ import annotations

from lora_sampler._testmode import set_testing
from lora_sampler.testing._adapters import write_adapter, write_adapter_archive
from lora_sampler.testing._bodies import VLLM_BODIES, VllmBody
from lora_sampler.testing._chat import CHAT_TEMPLATE, render_chat
from lora_sampler.testing._engine import FAULT_KINDS, FakeEngine, RequestRecord
from lora_sampler.testing._tokenizer import ByteTokenizer, decode_token, encode_text

__all__ = [
    "ByteTokenizer",
    "CHAT_TEMPLATE",
    "FAULT_KINDS",
    "VLLM_BODIES",
    "FakeEngine",
    "RequestRecord",
    "VllmBody",
    "decode_token",
    "encode_text",
    "render_chat",
    "set_testing",
    "write_adapter",
    "write_adapter_archive",
]
