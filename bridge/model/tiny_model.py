"""Tiny HF models for tests and the demo, built locally with no downloads.

Writes a complete HF directory (config.json, model.safetensors, tokenizer files) that
`transformers.AutoModelForCausalLM`, `AutoTokenizer` and vLLM all load. Weights are drawn
with numpy, so neither torch nor jax is needed to make one. The tokenizer is
character-level, built with `tokenizers`: one token per printable ASCII character plus
<pad>, <bos>, <eos>.

    python -m bridge.model.tiny_model --out=/tmp/tiny --family=qwen3
    python -m bridge.model.tiny_model --out=/tmp/tiny_moe --family=qwen3_moe
"""

from __future__ import annotations

import json
import os
import string

import numpy as np
from safetensors.numpy import save_file

from bridge.model import hf_files, layouts
from bridge.model.config import ModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def tiny_config(family: str = "qwen3", **overrides) -> ModelConfig:
    """A small config of a family. head_dim >= 32 because vLLM's CPU attention needs it."""
    vocab = len(char_vocab())
    base = dict(
        family=family,
        vocab_size=128 if vocab <= 128 else vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=family != "llama",
        attention_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        max_position_embeddings=512,
    )
    if family == "qwen3_moe":  # 8 experts, 2 a token: enough to route unevenly
        base.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    base.update(overrides)
    return ModelConfig(**base)


def random_hf_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF name -> fp32 array. Norm scales are 1 + noise so parity tests exercise them."""
    rng = np.random.default_rng(seed)
    out = {}
    for row in layouts.table(cfg):
        noise = rng.standard_normal(row.hf_shape)
        out[row.hf_name] = (1.0 + 0.1 * noise if row.norm else std * noise).astype(np.float32)
    return out


def save_tokenizer(path: str, model_max_length: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models

    vocab = char_vocab()
    # BPE with no merges over a character vocabulary = one token per character, spaces kept.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=2,
        )
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}, f)


def write_hf_config(
    path: str, cfg: ModelConfig, dtype: str = "float32", ids: tuple = (BOS_ID, EOS_ID, PAD_ID)
) -> None:
    bos, eos, pad = ids  # eos may be a list (generation stops at any of them)
    hf = cfg.to_hf_dict()
    first_eos = eos[0] if isinstance(eos, list) else eos
    hf.update(torch_dtype=dtype, bos_token_id=bos, eos_token_id=first_eos, pad_token_id=pad)
    with open(os.path.join(path, hf_files.CONFIG), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, f)


TOKENIZERS = ("char", "qwen3")


def make_tiny_model(
    path: str,
    cfg: ModelConfig | None = None,
    seed: int = 0,
    tokenizer: str = "char",
    never_stop: bool = False,
) -> str:
    """Write an HF model directory with random weights; returns `path`.

    tokenizer: "char" (one token per printable character, BOS/EOS/PAD) or "qwen3" (the
    real Qwen3 tokenizer format with its chat template, bridge/model/qwen3_tokenizer.py;
    `cfg.vocab_size` must cover its 265 tokens, see `qwen3_config`).
    never_stop: zero the output-head rows of the stop tokens (needs an untied head) and
    draw the others 25x larger, so a random model's stop tokens are ~e^-10 less likely
    than its top token and every answer runs to max_tokens (long-answer runs).
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    cfg = cfg or tiny_config()
    os.makedirs(path, exist_ok=True)
    if tokenizer == "qwen3":
        from bridge.model import qwen3_tokenizer as q3

        if cfg.vocab_size < q3.vocab_size():
            raise ValueError(f"vocab_size {cfg.vocab_size} < the tokenizer's {q3.vocab_size()}")
        q3.save_qwen3_tokenizer(path, cfg.max_position_embeddings)
        im_end, endoftext = q3.token_id(q3.EOS_TOKEN), q3.token_id(q3.PAD_TOKEN)
        # As Qwen3's own files: bos = pad = <|endoftext|>, generation stops at both.
        write_hf_config(path, cfg, ids=(endoftext, [im_end, endoftext], endoftext))
        stops = [im_end, endoftext]
    else:
        write_hf_config(path, cfg)
        save_tokenizer(path, cfg.max_position_embeddings)
        stops = [EOS_ID]
    weights = random_hf_weights(cfg, seed)
    if never_stop:
        if cfg.tie_word_embeddings:
            raise ValueError("never_stop needs an untied output head (tie_word_embeddings=False)")
        head = weights["lm_head.weight"] * 25.0
        head[stops] = 0.0
        weights["lm_head.weight"] = head
    save_file(weights, os.path.join(path, hf_files.SAFETENSORS), metadata={"format": "pt"})
    return path


def qwen3_config(**overrides) -> ModelConfig:
    """A small Qwen3 over the Qwen3-format tokenizer (vocab padded to a multiple of 16)."""
    from bridge.model import qwen3_tokenizer as q3

    vocab = -(-q3.vocab_size() // 16) * 16
    # Long answers need long positions (the char models' 512 would cap vLLM's max_model_len).
    base = {"vocab_size": vocab, "max_position_embeddings": 4096}
    return tiny_config("qwen3", **{**base, **overrides})


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="qwen3", choices=sorted(layouts.FAMILIES))
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_tiny_model(a.out, tiny_config(a.family, num_layers=a.num_layers), a.seed))


if __name__ == "__main__":
    main()
