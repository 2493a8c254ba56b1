"""The model architecture as plain data, read from an HF `config.json`.

Shared by both stacks: the Flax model is built from it, the layout tables are derived
from it, and the tiny-model factory writes it. Supported families are Qwen3 (q/k
RMSNorm, no qkv bias), Qwen2 (qkv bias, no q/k norm), Llama, and Qwen3-MoE (Qwen3's
attention; the MLP of the layers `is_moe_layer` names is a routed mixture of experts,
HF `qwen3_moe`).
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
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Families whose decoder layers may route tokens to experts.
MOE_FAMILIES = ("qwen3_moe",)
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
    # Mixture of experts (qwen3_moe; 0 / empty for dense families), HF's names and meaning:
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (I)
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in training

    def __post_init__(self):
        if self.family not in FAMILY_TO_ARCHITECTURE:
            raise ValueError(f"unknown model family {self.family!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.family in MOE_FAMILIES:
            if self.num_experts < 1 or self.moe_intermediate_size < 1:
                raise ValueError(
                    f"{self.family} needs num_experts >= 1 and moe_intermediate_size >= 1, "
                    f"got {self.num_experts} and {self.moe_intermediate_size}"
                )
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(
                    f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
                )
        elif self.num_experts:
            raise ValueError(f"family {self.family!r} has no experts (num_experts must be 0)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def architecture(self) -> str:
        return FAMILY_TO_ARCHITECTURE[self.family]

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is the routed experts (HF Qwen3MoeDecoderLayer's rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers in order; recorded routing is indexed by position in this."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = {
                "qwen3": "qwen3",
                "qwen2": "qwen2",
                "llama": "llama",
                "qwen3_moe": "qwen3_moe",
            }.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        if hf.get("rope_scaling"):
            raise ValueError(f"rope_scaling={hf['rope_scaling']} is not supported yet")
        num_heads = hf["num_attention_heads"]
        moe = {}
        if family in MOE_FAMILIES:
            moe = dict(
                num_experts=hf["num_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
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
            qk_norm=family in ("qwen3", "qwen3_moe"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            **moe,
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
        if self.family in ("qwen3", "qwen3_moe"):
            d["attention_bias"] = False
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.family in MOE_FAMILIES:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return d
