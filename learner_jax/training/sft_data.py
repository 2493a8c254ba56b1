"""SFT warm-start data: a task's (prompt, answer) pairs as fixed-shape learner batches.

Each row is `prompt tokens + answer tokens + EOS`, right-padded to `max_len + 1`; the loss
covers the answer and the EOS only, so the policy learns to answer and to stop. Text is
tokenized with the HF directory's `tokenizer.json` through `tokenizers` (no torch, no
transformers), exactly as the rollout workers see a prompt: the tokenizer's BOS (when it
has one) followed by the text's ids with no other special tokens
(`bridge/contracts/prompt.py`).

The example stream is the task's deterministic `sft_examples(seed)`; `SFTStream` counts
the examples it has consumed, so a resumed run skips exactly those (checkpoint cursor).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from bridge.contracts.prompt import TextCodec
from learner_jax.training.train_step import Batch, make_batch


def sft_rows(codec: TextCodec, pairs, max_len: int):
    """tokens, loss_mask, valid [B, max_len + 1] for (prompt, answer) pairs (long ones cut)."""
    tokens = np.full((len(pairs), max_len + 1), codec.pad_id, np.int32)
    mask = np.zeros((len(pairs), max_len + 1), np.float32)
    valid = np.zeros((len(pairs), max_len + 1), bool)
    for i, (prompt, answer) in enumerate(pairs):
        p = codec.encode_prompt(prompt)
        a = codec.encode(answer) + [codec.eos_id]
        row = (p + a)[: max_len + 1]
        tokens[i, : len(row)] = row
        mask[i, len(p) : len(row)] = 1.0
        valid[i, : len(row)] = True
    return tokens, mask, valid


class SFTStream:
    """Endless iterator of SFT `Batch`es from a task; `consumed` is the resume cursor."""

    def __init__(self, task, codec: TextCodec, batch_size: int, max_len: int, seed: int, skip=0):
        self.codec, self.batch_size, self.max_len = codec, batch_size, max_len
        self._examples = itertools.islice(task.sft_examples(seed), skip, None)
        self.consumed = skip

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        pairs = list(itertools.islice(self._examples, self.batch_size))
        if len(pairs) < self.batch_size:
            raise StopIteration
        self.consumed += len(pairs)
        tokens, mask, valid = sft_rows(self.codec, pairs, self.max_len)
        return make_batch(tokens, mask, valid)
