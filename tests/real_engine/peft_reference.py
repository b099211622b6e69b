"""The reference for scoring: each token's logprob under the tiny model (and an adapter), by transformers + peft.

Run with the Python of the vLLM venv (torch, transformers and peft); reads one JSON request on stdin and writes one
JSON answer on stdout::

    {"model_dir", "adapter_dirs": [null or a folder, ...], "sequences": [[token ids], ...], "texts": ["...", ...]}
    -> {"logprobs": [[[null, float, ...] per sequence] per adapter], "tokens": [[token ids of each text], ...]}

The forward pass is in fp32 on the CPU, as the engine's: ``logprobs[a][i][j]`` is ``log_softmax(logits[j - 1])`` at
token ``j`` of sequence ``i`` under adapter ``a`` (null: the base model alone; None for the first token).
``tokens`` is the model's own tokenizer on each text (with its special tokens), to compare with the engine's.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional


def _logprobs(model_dir: str, adapter_dir: Optional[str], sequences: List[List[int]]) -> List[List[Optional[float]]]:
    """Each token's logprob given those before it, under the model (and the adapter, when given)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    answers: List[List[Optional[float]]] = []
    with torch.no_grad():
        for sequence in sequences:
            ids = torch.tensor([sequence], dtype=torch.long)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            picked = logprobs[:-1].gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            answers.append([None, *(float(value) for value in picked)])
    return answers


def main() -> int:
    """Answer one request from stdin."""
    from transformers import AutoTokenizer

    request = json.load(sys.stdin)
    answers = [_logprobs(request["model_dir"], adapter, request["sequences"]) for adapter in request["adapter_dirs"]]
    tokenizer = AutoTokenizer.from_pretrained(request["model_dir"])
    tokens = [tokenizer(text)["input_ids"] for text in request.get("texts", [])]
    json.dump({"logprobs": answers, "tokens": tokens}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
