"""The reference for scoring: each token's logprob under the tiny model (and an adapter), by transformers + peft.

Run with the Python of the vLLM venv (torch, transformers and peft); reads one JSON request on stdin and writes one
JSON answer on stdout::

    {"model_dir", "adapter_dir" (or null), "sequences": [[token ids], ...], "texts": ["...", ...]}
    -> {"logprobs": [[null, float, ...], ...], "tokens": [[token ids of each text], ...]}

The forward pass is in fp32 on the CPU, as the engine's: ``logprobs[i][j]`` is ``log_softmax(logits[j - 1])`` at
token ``j`` of sequence ``i`` (None for the first token). ``tokens`` is the model's own tokenizer on each text (with
its special tokens), to compare with the engine's ``/tokenize``.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    """Answer one request from stdin."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    request = json.load(sys.stdin)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(request["model_dir"], torch_dtype=torch.float32)
    if request.get("adapter_dir"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, request["adapter_dir"])
    model.eval()
    answers = []
    with torch.no_grad():
        for sequence in request["sequences"]:
            ids = torch.tensor([sequence], dtype=torch.long)
            logits = model(input_ids=ids).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = logprobs[:-1].gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            answers.append([None, *(float(value) for value in picked)])
    tokenizer = AutoTokenizer.from_pretrained(request["model_dir"])
    tokens = [tokenizer(text)["input_ids"] for text in request.get("texts", [])]
    json.dump({"logprobs": answers, "tokens": tokens}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
