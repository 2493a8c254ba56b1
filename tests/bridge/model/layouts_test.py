"""Every parameter of every family is covered exactly once, in both directions."""

import numpy as np
import pytest

from bridge.model import layouts

from bridge.model import tiny_model

CONFIGS = {
    "qwen3_tied": tiny_model.tiny_config("qwen3", num_layers=3),
    "qwen3_untied": tiny_model.tiny_config("qwen3", num_layers=2, tie_word_embeddings=False),
    "qwen2_bias": tiny_model.tiny_config("qwen2", num_layers=2, num_kv_heads=4),
    "llama_untied": tiny_model.tiny_config("llama", num_layers=2, num_kv_heads=1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_table_matches_transformers_state_dict(name, tmp_path):
    """The HF side of the table is exactly the parameter set transformers builds."""
    import torch
    import transformers

    cfg = CONFIGS[name]
    path = tiny_model.make_tiny_model(str(tmp_path), cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_params = {k: tuple(v.shape) for k, v in model.named_parameters()}
    table_names = [r.hf_name for r in layouts.table(cfg)]
    assert len(table_names) == len(set(table_names)), "an HF name appears twice"
    assert set(table_names) == set(hf_params)
    assert layouts.hf_shapes(cfg) == hf_params
    flax_paths = [r.flax_path for r in layouts.table(cfg)]
    assert len(flax_paths) == len(set(flax_paths)), "a Flax path appears twice"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bit_exact(name):
    cfg = CONFIGS[name]
    hf = tiny_model.random_hf_weights(cfg, seed=3)
    back = dict(layouts.flax_to_hf(cfg, layouts.hf_to_flax(cfg, hf)))
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_heads_in_layout_matches_hf_reshape():
    """Flax q kernel [D, N, H]: q[d, n, h] multiplies HF weight row n*H + h, column d."""
    cfg = CONFIGS["qwen3_tied"]
    hf = tiny_model.random_hf_weights(cfg, seed=1)
    flax = layouts.hf_to_flax(cfg, hf)
    w = hf["model.layers.0.self_attn.q_proj.weight"]
    k = flax["layers_0"]["attn"]["q_proj"]["kernel"]
    n, h = 2, 5
    np.testing.assert_array_equal(k[:, n, h], w[n * cfg.head_dim + h, :])
    o = flax["layers_0"]["attn"]["o_proj"]["kernel"]
    wo = hf["model.layers.0.self_attn.o_proj.weight"]
    np.testing.assert_array_equal(o[n, h, :], wo[:, n * cfg.head_dim + h])


def test_missing_or_extra_tensors_are_refused():
    cfg = CONFIGS["qwen2_bias"]
    hf = tiny_model.random_hf_weights(cfg)
    hf.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        layouts.hf_to_flax(cfg, hf)
    hf = tiny_model.random_hf_weights(cfg)
    hf["lm_head.weight"] = np.zeros((1,))
    with pytest.raises(ValueError, match="lm_head.weight"):
        layouts.hf_to_flax(cfg, hf)
