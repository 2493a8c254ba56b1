"""Architectures of real released models, for benchmarks and sizing (no weights, no download)."""

from bridge.model.config import ModelConfig


def _qwen3(hidden: int, intermediate: int, num_layers: int) -> ModelConfig:
    """A Qwen3 dense architecture: the released family's shared settings."""
    return ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=40960,
    )


def qwen3_0p6b(num_layers: int = 28) -> ModelConfig:
    """Qwen3-0.6B's architecture (596,049,920 parameters at 28 layers)."""
    return _qwen3(1024, 3072, num_layers)


def qwen3_1p7b(num_layers: int = 28) -> ModelConfig:
    """Qwen3-1.7B's architecture (1,720,574,976 parameters at 28 layers, embedding tied)."""
    return _qwen3(2048, 6144, num_layers)


def qwen3_30b_a3b(num_layers: int = 48) -> ModelConfig:
    """Qwen3-30B-A3B's architecture: every layer routes each token to 8 of 128 experts of
    width 768 (norm_topk_prob), attention 32 heads over 4 kv heads, untied head."""
    return ModelConfig(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.001,
    )
