"""The presets have their released models' sizes: total and non-embedding parameter counts
as the Qwen3 model cards round them (0.6B / 0.44B, 1.7B / 1.4B), counted by the layout
table that maps every parameter to its HF tensor."""

import math

import pytest

from bridge.model import layouts, presets


def counts(cfg):
    total = sum(math.prod(row.hf_shape) for row in layouts.table(cfg))
    return total, total - cfg.vocab_size * cfg.hidden_size  # tied: one embedding matrix


# (preset, exact total, the card's non-embedding count, half a unit of its last digit)
@pytest.mark.parametrize(
    "preset, total, non_embedding, half_unit",
    [(presets.qwen3_0p6b, 596_049_920, 0.44e9, 0.005e9),
     (presets.qwen3_1p7b, 1_720_574_976, 1.4e9, 0.05e9)],
)  # fmt: skip
def test_parameter_counts_match_the_model_cards(preset, total, non_embedding, half_unit):
    cfg = preset()
    assert cfg.tie_word_embeddings and cfg.vocab_size == 151936 and cfg.num_layers == 28
    got_total, got_non_embedding = counts(cfg)
    assert got_total == total
    assert got_non_embedding == pytest.approx(non_embedding, abs=half_unit)
