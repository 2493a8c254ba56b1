"""Prompt token ids, the one encoding both stacks use: BOS (if the tokenizer has one), then
the prompt text encoded without special tokens.

The learner and the controller tokenize with `TextCodec` (the `tokenizers` library on the
HF directory's tokenizer.json); a worker tokenizes with its engine's HF tokenizer. Both
go through `prompt_ids`, so a prompt means the same ids on both sides.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


def prompt_ids(bos_id: int | None, text_ids: Sequence[int]) -> list[int]:
    """BOS (if any) followed by the text's ids."""
    return ([bos_id] if bos_id is not None else []) + [int(t) for t in text_ids]


class TextCodec:
    """Tokenizer of an HF dir: text -> ids, plus its EOS and PAD ids."""

    def __init__(self, hf_dir: str):
        from tokenizers import Tokenizer

        path = os.path.join(hf_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{hf_dir} has no tokenizer.json")
        self.tok = Tokenizer.from_file(path)
        special = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            p = os.path.join(hf_dir, name)
            if os.path.exists(p):
                with open(p) as f:
                    for k, v in json.load(f).items():
                        special.setdefault(k, v["content"] if isinstance(v, dict) else v)
        self.eos_id = self._id(special.get("eos_token"))
        self.bos_id = self._id(special.get("bos_token"))
        pad = self._id(special.get("pad_token"))
        self.pad_id = pad if pad is not None else self.eos_id
        if self.eos_id is None:
            raise ValueError(f"{hf_dir}: tokenizer config names no eos_token")

    def _id(self, token):
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids as the rollout workers build them (`prompt_ids`)."""
        return prompt_ids(self.bos_id, self.encode(text))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)
