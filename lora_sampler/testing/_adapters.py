"""Adapter files for FakeEngine: writing a minimal valid adapter and judging a directory as vLLM's loader does.

Owns the config/weights file names and the safetensors header check; it keeps no adapter table, LRU or
visibility delays (those are FakeEngine state) and does no HTTP. Stdlib only.
"""

from __future__ import annotations

import json
import os
import struct
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Any

#: Read by the filesystem resolver and the load endpoint.
CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_NO_TENSORS = "{} doesn't contain tensors"  # the worker's error
_INCOMPLETE = "Error while deserializing header: incomplete metadata, file not fully covered"  # as vLLM says it


def write_adapter(path: str | os.PathLike[str], base_model: str, *, rank: int = 8, peft_type: str = "LORA") -> str:
    """Write a minimal adapter the fake engine accepts: ``adapter_config.json`` and a valid tiny safetensors file."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": peft_type, "base_model_name_or_path": base_model, "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = ["q_proj", "v_proj"]
    with open(os.path.join(path, CONFIG_NAME), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    tensor = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps({tensor: {"dtype": "F32", "shape": [rank, 4], "data_offsets": [0, rank * 16]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(path, WEIGHT_NAMES[0]), "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + bytes(rank * 16))
    return path


def write_adapter_archive(
    path: str | os.PathLike[str], base_model: str, *, rank: int = 8, peft_type: str = "LORA"
) -> str:
    """Write a ready ``.tar.gz`` adapter checkpoint for ``base_model`` (what ``publish`` and ``adapter=`` take).

    The archive holds ``adapter_config.json`` and a valid tiny ``adapter_model.safetensors`` at its top level, as a
    training run saves them; missing parent folders are created. Returns the path.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        write_adapter(folder, base_model, rank=rank, peft_type=peft_type)
        with tarfile.open(path, "w:gz") as tar:
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=name)
    return path


def safetensors_error(path: str) -> str | None:
    """Return the loader's complaint about a safetensors file, or None when its data covers the header exactly."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                return "Error while deserializing header: HeaderTooSmall"
            (length,) = struct.unpack("<Q", handle.read(8))
            if 8 + length > size:
                return "Error while deserializing header: InvalidHeaderLength"
            header = json.loads(handle.read(length))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return "Error while deserializing header: InvalidHeaderDeserialization"
    if not ends:
        return _NO_TENSORS.format(os.path.dirname(path))
    return None if 8 + length + max(ends) == size else _INCOMPLETE


@dataclass(frozen=True)
class AdapterFiles:
    """What the loader finds in an adapter directory: verdict in absent/json/rank/no_weights/bad_weights/ok."""

    verdict: str
    detail: str = ""
    config: Any = None


def inspect_adapter(path: str, max_lora_rank: int) -> AdapterFiles:
    """Read an adapter directory the way vLLM's resolver and worker do."""
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        return AdapterFiles("absent")
    try:
        with open(config_path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return AdapterFiles("absent")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        return AdapterFiles("json", str(exc))
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, int) and rank > max_lora_rank:
        return AdapterFiles("rank", f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.", config)
    safetensors, binary = (os.path.join(path, name) for name in WEIGHT_NAMES)
    if os.path.isfile(safetensors):
        problem = safetensors_error(safetensors)
        return AdapterFiles("bad_weights", problem, config) if problem else AdapterFiles("ok", "", config)
    if os.path.isfile(binary) and os.path.getsize(binary) > 0:
        return AdapterFiles("ok", "", config)
    return AdapterFiles("no_weights", _NO_TENSORS.format(path), config)
