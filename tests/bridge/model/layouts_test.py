"""Every parameter of every family is covered exactly once, in both directions."""

import numpy as np
import pytest

from bridge.model import layouts, tiny_model

CONFIGS = {
    "qwen3_tied": tiny_model.tiny_config("qwen3", num_layers=3),
    "qwen3_untied": tiny_model.tiny_config("qwen3", num_layers=2, tie_word_embeddings=False),
    "qwen2_bias": tiny_model.tiny_config("qwen2", num_layers=2, num_kv_heads=4),
    "llama_untied": tiny_model.tiny_config("llama", num_layers=2, num_kv_heads=1),
    # MoE layers 0 and 2 (layer 1 dense: mlp_only_layers), untied head
    "qwen3_moe": tiny_model.tiny_config(
        "qwen3_moe", num_layers=3, mlp_only_layers=(1,), tie_word_embeddings=False
    ),
}
DENSE = sorted(n for n, c in CONFIGS.items() if not c.num_experts)


@pytest.mark.parametrize("name", DENSE)
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
    norms = {
        f"{n}.weight" for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")
    }
    assert {r.hf_name for r in layouts.table(cfg) if r.norm} == norms


def test_moe_table_is_the_checkpoint_transformers_loads_and_writes(tmp_path):
    """MoE: transformers >= 5 fuses the per-expert checkpoint tensors into stacked
    parameters (gate_up_proj [E, 2I, D], down_proj [E, D, I]) when it loads. The table's HF
    side is the checkpoint form: exactly the names and shapes transformers writes back, and
    each Flax expert slice is the same expert's slice of transformers' fused parameters
    (an expert swapped or a projection transposed in the table fails here)."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    cfg = CONFIGS["qwen3_moe"]
    path = tiny_model.make_tiny_model(str(tmp_path / "in"), cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    model.save_pretrained(str(tmp_path / "out"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == layouts.hf_shapes(cfg)
    flax = layouts.hf_to_flax(cfg, written)
    hf = dict(model.named_parameters())
    m = cfg.moe_intermediate_size
    assert cfg.moe_layers == (0, 2)
    for i in cfg.moe_layers:
        experts = flax[f"layers_{i}"]["mlp"]["experts"]
        gate_up = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].detach().numpy()
        down = hf[f"model.layers.{i}.mlp.experts.down_proj"].detach().numpy()
        # Flax [E, D, I] / [E, I, D] are the [in, out] transposes of HF's [E, out, in].
        np.testing.assert_array_equal(experts["gate_proj"], gate_up[:, :m].transpose(0, 2, 1))
        np.testing.assert_array_equal(experts["up_proj"], gate_up[:, m:].transpose(0, 2, 1))
        np.testing.assert_array_equal(experts["down_proj"], down.transpose(0, 2, 1))
        router = hf[f"model.layers.{i}.mlp.gate.weight"].detach().numpy()
        np.testing.assert_array_equal(flax[f"layers_{i}"]["mlp"]["gate"]["kernel"], router.T)
    assert "gate_proj" in flax["layers_1"]["mlp"]  # the dense layer keeps the dense rows
    assert not [r for r in layouts.table(cfg) if r.norm and "mlp" in r.hf_name]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_row_knows_both_shapes(name):
    """A row's HF shape is what its transform makes of its Flax shape, and back (an expert
    row's from_hf is its slice of the stacked leaf)."""
    for row in layouts.table(CONFIGS[name]):
        sliced = row.flax_shape[1:] if row.transform.expert is not None else row.flax_shape
        assert row.transform.to_hf(np.zeros(row.flax_shape)).shape == row.hf_shape, row.hf_name
        assert row.transform.from_hf(np.zeros(row.hf_shape)).shape == sliced, row.hf_name


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


N, H, D = 4, 8, 6  # heads, head dim, model dim of the shard-mapping cases


@pytest.mark.parametrize(
    "transform, shape, grid",
    [
        (layouts.IDENTITY, (12, D), (3, 2)),
        (layouts.LINEAR, (D, 12), (2, 3)),
        (layouts.heads_in(N, H), (D, N, H), (2, 2, 1)),
        (layouts.heads_in(N, H), (D, N, H), (1, 2, 2)),  # partial H, 2 heads per block
        (layouts.heads_in(N, H), (D, N, H), (3, 1, 4)),  # partial H, every head
        (layouts.heads_bias(N, H), (N, H), (2, 1)),
        (layouts.heads_bias(N, H), (N, H), (1, 4)),
        (layouts.heads_out(N, H), (N, H, D), (2, 1, 2)),
        (layouts.heads_out(N, H), (N, H, D), (2, 2, 3)),
        # MoE: expert 5 of 8, the expert axis split in 4 (two experts a block) and 8
        (layouts.expert_linear(5), (8, D, 12), (4, 2, 3)),
        (layouts.expert_linear(5), (8, D, 12), (8, 1, 1)),
    ],
)
def test_shard_pieces_tile_the_hf_array(transform, shape, grid):
    """Every block of a grid over the Flax array, cut and converted as `shard_pieces` says,
    lands where `to_hf` of the whole array puts it, covering each element exactly once."""
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    want = transform.to_hf(values)
    out, count = np.full(want.shape, np.nan, np.float32), np.zeros(want.shape, int)
    steps = [n // g for n, g in zip(shape, grid, strict=True)]
    for corner in np.ndindex(*grid):
        index = tuple(slice(c * s, (c + 1) * s) for c, s in zip(corner, steps, strict=True))
        for hf_index, local in transform.shard_pieces(index, shape):
            out[hf_index] = transform.to_hf(values[index][local])
            count[hf_index] += 1
    np.testing.assert_array_equal(count, 1)
    np.testing.assert_array_equal(out, want)
