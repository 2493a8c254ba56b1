"""A small tokenizer in the real Qwen3 format, built locally (no download).

What makes it Qwen3's format, as its tokenizer files are on the Hub (Qwen/Qwen3-0.6B):
byte-level BPE behind Qwen2's pre-tokenizer regex and NFC normalization; Qwen3's added
tokens (<|endoftext|>, <|im_start|>, <|im_end|> special; <think>, </think>, <tool_call>,
... not special, so decoding keeps them); no BOS token; EOS <|im_end|>, PAD <|endoftext|>;
`tokenizer_class` Qwen2Tokenizer; and Qwen3's chat template verbatim
(`qwen3_chat_template.jinja`, the hybrid-thinking template of Qwen/Qwen3-0.6B..8B, with its
`enable_thinking` switch). What differs: the vocabulary is the 256 byte symbols with no
merges (one token per UTF-8 byte) instead of 151,643 learned merges, so a model over it
can be small; ids are therefore small too (added tokens follow the bytes).

    save_qwen3_tokenizer("/tmp/model")  # tokenizer.json, tokenizer_config.json, ...
"""

from __future__ import annotations

import json
import os

# Qwen2/Qwen3's pre-tokenizer split (tokenizer.json "pre_tokenizer" of the Qwen models).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (content, special) in Qwen3's order.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "qwen3_chat_template.jinja")


def chat_template() -> str:
    with open(TEMPLATE_PATH, encoding="utf-8") as f:
        return f.read()


def build_tokenizer():
    """The `tokenizers.Tokenizer` (byte-level BPE, Qwen2 split, Qwen3 added tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    vocab = {sym: i for i, sym in enumerate(sorted(pre.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    return tok


def vocab_size() -> int:
    return 256 + len(ADDED_TOKENS)


def token_id(content: str) -> int:
    """Id of an added token: they follow the 256 byte symbols in ADDED_TOKENS order."""
    return 256 + [t for t, _ in ADDED_TOKENS].index(content)


def save_qwen3_tokenizer(path: str, model_max_length: int = 40960) -> None:
    """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) into `path`."""
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer()
    tok.save(os.path.join(path, "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for t, s in ADDED_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, f)
