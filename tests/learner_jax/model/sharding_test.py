"""Real sharding on 8 virtual CPU devices, and abstract builds of the real Qwen3 sizes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tolerance import assert_close_at_scale
from jax.sharding import PartitionSpec as P

from bridge.model import tiny_model
from bridge.model.config import ModelConfig
from learner_jax.model import model, sharding

MESH_SHAPE = {"data": 2, "fsdp": 2, "tensor": 2}


def test_make_mesh():
    mesh = sharding.make_mesh(MESH_SHAPE)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == MESH_SHAPE
    assert dict(sharding.make_mesh({"fsdp": -1, "tensor": 2}).shape) == {
        "data": 1,
        "fsdp": 4,
        "tensor": 2,
    }
    assert sharding.make_mesh({"data": 2}, devices=jax.devices()[:2]).size == 2
    with pytest.raises(ValueError, match="spans 4 devices, but 8"):
        sharding.make_mesh({"data": 2, "tensor": 2})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.make_mesh({"model": 8})
    with pytest.raises(ValueError, match="does not divide"):
        sharding.make_mesh({"data": 3, "fsdp": -1})


def test_rules_from_config_data():
    as_lists = [
        [name, list(axes) if isinstance(axes, tuple) else axes]
        for name, axes in sharding.DEFAULT_RULES
    ]
    assert sharding.normalize_rules(as_lists) == sharding.DEFAULT_RULES
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.normalize_rules([("embed", "model")])
    with pytest.raises(ValueError, match="pair"):
        sharding.normalize_rules([("embed",)])


def _forward(cfg, params, batch, options=None):
    net = model.Transformer(cfg, options=options or model.ModelOptions())
    return jax.jit(lambda p, *b: net.apply({"params": p}, *b))(params, *batch)


def test_sharded_forward_equals_single_device():
    cfg = tiny_model.tiny_config("qwen3", num_layers=2, tie_word_embeddings=False)
    mesh = sharding.make_mesh(MESH_SHAPE)
    params = sharding.sharded_init(cfg, mesh, sharding.DEFAULT_RULES, jax.random.key(3))

    def spec(*path):
        x = params
        for k in path:
            x = x[k]
        assert x.addressable_shards[0].data.size < x.size  # really split
        return x.sharding.spec

    assert spec("embed", "embedding") == P("tensor", "fsdp")
    assert spec("layers_0", "attn", "q_proj", "kernel") == P("fsdp", "tensor", None)
    assert spec("layers_1", "attn", "k_proj", "kernel") == P("fsdp", "tensor", None)
    assert spec("layers_0", "attn", "o_proj", "kernel") == P("tensor", None, "fsdp")
    assert spec("layers_0", "mlp", "gate_proj", "kernel") == P("fsdp", "tensor")
    assert spec("layers_1", "mlp", "down_proj", "kernel") == P("tensor", "fsdp")
    assert spec("lm_head", "kernel") == P("fsdp", "tensor")
    q = params["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.addressable_shards[0].data.shape == (32, 2, 32)  # [D/fsdp, N/tensor, H]
    assert len(q.sharding.device_set) == 8

    seg = np.ones((4, 10), np.int32)
    seg[0, :3] = 0  # left padded
    seg[2, 7:] = 0  # right padded
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, seg.shape).astype(np.int32)
    batch = (tokens, model.positions_from_segments(seg), seg)
    single = jax.device_put(jax.device_get(params), jax.devices()[0])
    ref = np.asarray(_forward(cfg, single, batch))
    with sharding.use_mesh(mesh):
        out = _forward(cfg, params, batch)
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")  # activation constraints
    assert np.abs(np.asarray(out) - ref).max() <= 1e-5


def test_sharded_blockwise_attention_equals_single_device_reference():
    """'blockwise' (tiled, scanned) on the (data, fsdp, tensor) mesh, heads split over
    tensor, against the unsharded 'xla' reference; packed and padded rows."""
    cfg = tiny_model.tiny_config("qwen3", num_layers=2, num_heads=8, num_kv_heads=4)
    mesh = sharding.make_mesh(MESH_SHAPE)
    params = sharding.sharded_init(cfg, mesh, sharding.DEFAULT_RULES, jax.random.key(4))
    params = jax.tree.map(lambda x: x * 2, params)  # logits std ~0.6, like model_test
    seg = np.ones((4, 13), np.int32)
    seg[0, :3] = 0
    seg[1, 6:] = 2
    seg[2, 9:] = 0
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, seg.shape).astype(np.int32)
    batch = (tokens, model.positions_from_segments(seg), seg)
    single = jax.device_put(jax.device_get(params), jax.devices()[0])
    ref = np.asarray(_forward(cfg, single, batch, model.ModelOptions(attention="xla")))
    blockwise = model.ModelOptions(attention="blockwise", attention_block=4)
    with sharding.use_mesh(mesh):
        out = _forward(cfg, params, batch, blockwise)
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")
    out = np.asarray(out)
    assert np.isfinite(out).all() and ref[seg > 0].std() > 0.5
    assert_close_at_scale(out[seg > 0], ref[seg > 0])  # rounding of the logits' scale


def test_indivisible_dims_are_replicated():
    """1 kv head on tensor=2: that dim is replicated, the rest still sharded, forward runs."""
    cfg = tiny_model.tiny_config("qwen2", num_layers=1, num_kv_heads=1)
    mesh = sharding.make_mesh(MESH_SHAPE)
    shardings = sharding.param_shardings(cfg, mesh)
    assert shardings["layers_0"]["attn"]["k_proj"]["kernel"].spec == P("fsdp", None, None)
    assert shardings["layers_0"]["attn"]["k_proj"]["bias"].spec == P(None, None)
    assert shardings["layers_0"]["attn"]["q_proj"]["bias"].spec == P("tensor", None)
    params = sharding.sharded_init(cfg, mesh)
    seg = np.ones((4, 6), np.int32)
    with sharding.use_mesh(mesh):
        out = _forward(cfg, params, (seg + 3, model.positions_from_segments(seg), seg))
    assert np.isfinite(np.asarray(out)).all()


# The real Qwen3 config.json fields that shape the model (from the HF hub).
QWEN3 = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, tie_word_embeddings=False),
}  # fmt: skip
PUBLISHED_COUNTS = {"0.6B": 596_049_920, "4B": 4_022_468_096, "8B": 8_190_735_360}


def qwen3_hf_config(size):
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        **QWEN3[size],
    }


def count_by_formula(hf):
    """Independent count from config.json alone."""
    d, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    n, k, h, v = (
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["head_dim"],
        hf["vocab_size"],
    )
    attn = d * n * h + 2 * d * k * h + n * h * d + 2 * h  # q, k, v, o, q_norm, k_norm
    per_layer = attn + 3 * d * f + 2 * d  # + gate, up, down, two norms
    head = 0 if hf["tie_word_embeddings"] else v * d
    return v * d + layers * per_layer + d + head


@pytest.mark.parametrize("size", sorted(QWEN3))
def test_real_qwen3_sizes_build_abstractly(size):
    hf = qwen3_hf_config(size)
    cfg = ModelConfig.from_hf_dict(hf)
    mesh = sharding.make_mesh(MESH_SHAPE)
    init = sharding.sharded_init_fn(cfg, mesh, param_dtype=jnp.bfloat16)
    abstract = jax.eval_shape(init, jax.random.key(0))  # traced, never allocated
    leaves = jax.tree.leaves(abstract)
    count = sum(math.prod(x.shape) for x in leaves)
    assert count == count_by_formula(hf) == PUBLISHED_COUNTS[size]
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    emb = abstract["embed"]["embedding"]
    assert emb.shape == (151936, hf["hidden_size"])
    assert emb.sharding.spec == P("tensor", "fsdp")
    q = abstract["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert ("lm_head" in abstract) == (not hf["tie_word_embeddings"])
    if size == "0.6B":  # the forward also traces at full size, with its constraints
        b = jax.ShapeDtypeStruct((4, 16), jnp.int32)
        with sharding.use_mesh(mesh):
            logits = jax.eval_shape(
                lambda p, t: model.Transformer(cfg, dtype=jnp.bfloat16).apply(
                    {"params": p}, t, t, t
                ),
                abstract,
                b,
            )
        assert logits.shape == (4, 16, 151936) and logits.dtype == jnp.float32
