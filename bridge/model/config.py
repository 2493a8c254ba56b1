"""The model architecture as plain data, read from an HF `config.json`.

Shared by both stacks: the Flax model is built from it, the layout tables are derived
from it, and the tiny-model factory writes it. Supported families are Qwen3 (q/k
RMSNorm, no qkv bias), Qwen2 (qkv bias, no q/k norm) and Llama.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# HF architecture name -> our family name.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
FAMILY_TO_ARCHITECTURE = {v: k for k, v in ARCHITECTURES.items()}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2 always, Llama optional)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.family not in FAMILY_TO_ARCHITECTURE:
            raise ValueError(f"unknown model family {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def architecture(self) -> str:
        return FAMILY_TO_ARCHITECTURE[self.family]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(
                hf.get("model_type", "")
            )
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        if hf.get("rope_scaling"):
            raise ValueError(f"rope_scaling={hf['rope_scaling']} is not supported yet")
        num_heads = hf["num_attention_heads"]
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json fields transformers and vLLM need to rebuild this model."""
        d = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.family == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.family == "qwen3":
            d["attention_bias"] = False
        if self.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        return d
