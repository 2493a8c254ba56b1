"""The files of an HF model directory: which hold weights, which are config and tokenizer.

One definition for everything that copies or reads such a directory: the export writes
its own weights and copies every other file (`model_files`); the learner's checkpoint
copy does the same; the store carries only `ENGINE_FILES` to remote workers, since a
worker takes nothing from the store that vLLM would not read anyway; the importer reads
the safetensors files the directory names (`safetensors_files`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")
WEIGHT_INDICES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")
# A directory with a config and neither of these cannot build a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What vLLM and transformers read to build an engine and a tokenizer (never weights).
ENGINE_FILES = (
    CONFIG,
    "generation_config.json",
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDICES


def model_files(hf_dir: str, allowed: Collection[str] | None = None) -> list[str]:
    """Sorted names of the regular non-weight files in `hf_dir` (only `allowed` ones if given)."""
    return [
        name
        for name in sorted(os.listdir(hf_dir))
        if os.path.isfile(os.path.join(hf_dir, name))
        and not is_weight_file(name)
        and (allowed is None or name in allowed)
    ]


def has_tokenizer(hf_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES)


def safetensors_files(hf_dir: str) -> list[str]:
    """The safetensors files holding the weights: those of the index, or the single file."""
    index_path = os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.exists(index_path):
        with open(index_path) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(hf_dir, SAFETENSORS)):
        return [SAFETENSORS]
    raise FileNotFoundError(f"{hf_dir}: neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")
